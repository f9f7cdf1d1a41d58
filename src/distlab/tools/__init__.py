"""What a reader keeps using after the book: ``debug`` (Lockstep, check_replicas, the
flight-recorder analyser), ``runs`` (the run-log CLI, ``python -m distlab.tools.runs``), the
memory calculator (``memory_calculator``, ``calculator_page``) and ``dtypes`` (which dtype each
operator really ran in) and ``sharding`` (an ``IterableDataset`` split by rank x DataLoader worker).
May import the training library and ``infra``."""
