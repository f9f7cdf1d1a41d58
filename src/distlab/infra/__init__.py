"""Plumbing for pages, benchmarks and tests. Launching ranks from a notebook: ``launch``
(``run_ranks``, ``run_script``) on top of ``launcher`` (the launcher child, its
forkserver and logs), with ``ports`` (free ports on 127.0.0.1) and ``processes``
(process trees, through psutil); ``observe`` runs ranks that are expected to fail and
reports what happened. Also ``paths`` (where things are in the repository),
``experiment`` (the harness: build, wrap by strategy name, train N steps, time),
``tables`` (Markdown tables) and ``labdiff`` (the diff between two labs). May import the
training library and ``scratch``."""
