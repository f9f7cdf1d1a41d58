"""distlab: the code of the book, by role. Start here to find where a piece lives
or goes.

The training library (this folder's own modules): what the six lab scripts in
``src/labs/`` import, and nothing else. An API for six scripts: change it and every
lab's diff changes.

    model       the GPT. Frozen: never changed for parallelism (a test holds its
                sha256)
    data        the corpus (Tiny Shakespeare ships in ``corpus/``), the tokenizer,
                batches by rank
    runtime     the one place that picks device, backend and dtype; joins the process
                group
    parallel    DDP, FSDP2, activation checkpointing and torch.compile, applied to the
                model from outside
    checkpoint  save and resume with DCP; plain weights in and out; a preemption
                signal saves and stops
    accel       lab 6's Accelerator, its prepare, and the checks that turn its quiet
                fallbacks into errors
    cli         a config dataclass from the command line; one-line errors
    errors      ``UserError``: a mistake the user can fix, reported in one line
    metrics     metrics.jsonl and summary.json of a run; the steps between logs, timed
                (LogWindow)
    flops       FLOPs per token, the measured matmul peak, MFU
    memory      bytes of model state, activations, and the peak by kind (PyTorch's
                MemTracker)

Around it, one subpackage per role:

    scratch/    the mechanisms rebuilt by hand (collectives, data_parallel, ddp, fsdp,
                zero1, a halving-doubling all-reduce, SyncBatchNorm,
                DistributedSampler's deal), each tested equal to PyTorch's own, with
                the pictures and stepping widgets drawn from them
    chapters/   one module per chapter page, named after it: ``chapters/fsdp2.py``
                holds the experiments ``book/fsdp2.md`` runs
    exercises/  the checkers of the exercises that ask for code, named after their page
    costs/      the cost model, pure arithmetic and nothing else: collectives on a
                ring (and tree, halving-doubling, in-network, hierarchical) with
                NCCL's latencies and a channel per NIC across nodes, DDP's buckets,
                bytes of model state, a GPT-2 and a Llama block's activations,
                training FLOPs per token, the strategies as data rows; every other
                role reads its formulas from here
    planner/    the capstone planner (``python -m distlab.planner``): model shapes,
                GPUs and networks with their sources, the inputs and their checks,
                predict (memory and step time), the communication timeline, the
                recommender, the published runs as data (``runs/``), the calibration
                on them with leave-one-out, a torchtitan-style Llama block measured on
                the CPU, this machine's check, the page's form
    tools/      what a reader keeps using after the book, one instrument a module
                (listed in ``tools/__init__.py``): debugging tools, the run-log CLI,
                the memory calculator, the DDP step model, counters of collectives
                and their bytes, a straggler detector, an exact evaluation
    figures/    the pictures pages draw from real objects and runs (what each rank
                holds, who sends what to whom, a save step by step, ...)
    bench/      the benchmarks (``python -m distlab.bench``,
                ``python -m distlab.bench.ddp``, ...), the lab scripts as the labs
                benchmark runs them (``lab_scripts``), the recorded results'
                provenance, and their reading: goals met only outside the repeats'
                spread (``report``), bytes held and sent per strategy (``bench_bytes``)
    infra/      plumbing for pages and tests: launching ranks from a notebook,
                repository paths, the experiment harness, tables, lab diffs, the
                page anatomy (``page_anatomy``; pages' sources read by ``myst``),
                live timings worded with a guard (``claims``), the DDP lab pages'
                figures (``ddp_labs``), the stepping widgets (``stepper``), the landing
                page's reading path (``reading_path``: core pages and reference
                pages, with reading times computed from their sources) and its
                figures (``landing``)

Who may import whom (an arrow is "may import"; nothing imports upward):

    labs (src/labs/)       -> the training library
    costs/                 -> itself (pure arithmetic)
    the training library   -> itself, costs/
    scratch/               -> the training library, costs/
    infra/                 -> the training library, costs/, scratch/
    planner/               -> the training library, costs/, infra/
    tools/                 -> the training library, costs/, infra/, planner/
    figures/               -> all of the above
    chapters/, exercises/  -> all of the above
    bench/                 -> all of the above

Adding a chapter ``book/<page>.md``: its experiments go to ``chapters/<page>.py``, its
tests to ``tests/chapters/test_<page>.py``, its exercise checker (if it asks for code)
to ``exercises/<page>.py``; add the page to ``_toc.yml``. A mechanism built from scratch
goes to ``scratch/`` with a test that it equals PyTorch's. The house rules the tests
enforce are in CONTRIBUTING.md.
"""
