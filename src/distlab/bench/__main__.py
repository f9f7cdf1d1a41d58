"""``python -m distlab.bench``: the benchmark of labs 1-6 (see ``distlab.bench.labs``)."""

from distlab.bench.labs import main

main()
