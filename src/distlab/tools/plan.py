"""``python -m distlab.tools.plan``: the planner's command line, at its first address.
The planner lives in ``distlab.planner`` (``python -m distlab.planner``)."""

import sys

from distlab.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
