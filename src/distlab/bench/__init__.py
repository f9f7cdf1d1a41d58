"""The benchmarks: ``python -m distlab.bench`` runs labs 1-6 (``labs``, read by ``report``), and
``python -m distlab.bench.ddp|dp|fsdp|ac|comm_hooks`` measure what single chapters read. Each writes a result
to ``results/`` with its provenance (``provenance``); pages read the recordings and never rerun
them. May import anything in distlab."""
