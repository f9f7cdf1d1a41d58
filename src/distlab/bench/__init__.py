"""The benchmarks: ``python -m distlab.bench`` runs labs 1-6 (``labs``, the scripts read
by ``lab_scripts``, the result by ``report``), and ``python -m
distlab.bench.ddp|dp|fsdp|ac|comm_hooks|collectives`` measure what single chapters read;
the GPU benchmarks ``fsdp_offload``, ``fsdp_compile``, ``ac_policies`` and ``float8``
(which needs torchao and an sm_89+ GPU) do too, and ``backward_ready`` (when backward
completes each gradient of GPT-2 small, on a GPU); ``planner_inputs`` measures what the
planner needs to know of this CPU (matmul and attention rates, copy bandwidth, gloo's
alpha-beta fit); ``gpu_check`` is the one check a GPU owner runs (``make gpu-check``:
the GPU suite, labs 1 and 4 measured, a profile of a lab 4 step). Each writes a result
to ``results/`` with its provenance (``provenance``); pages read the recordings and
never rerun them. May import anything in distlab."""
