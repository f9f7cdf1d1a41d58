"""``python -m distlab.bench``: the benchmark of labs 1-6 (see
``distlab.bench.labs``)."""

from distlab.bench.labs import main
from distlab.cli import run

# a UserError (too many ranks for the GPUs...) ends in one line
run(main, "python -m distlab.bench")
