"""``python -m distlab.planner``: the planner's command line
(``distlab.planner.cli``)."""

import sys

from distlab.planner.cli import main

sys.exit(main())
