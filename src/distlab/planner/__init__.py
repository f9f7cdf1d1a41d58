"""The capstone planner: memory per GPU and tokens/s of a data-parallel run, before it
runs (``python -m distlab.planner``; book/planner.md). May import the training library,
``costs`` and ``infra``.

    shapes        model sizes (the book's GPT, GPT-2, Llama 3): parameters, FLOPs
    hardware      GPUs and networks, each number with its source
    inputs        a device, a cluster, a plan, and the checks on them
    predict       memory by part, and a step's time term by term
    comm          each strategy's collectives, laid on a compute/communication timeline
    recommend     every plan that fits, fastest first
    runs/         published runs as data, one module per source
    calibrate     the GEMM efficiency each run implies; every run left out in turn
    llama_block   a torchtitan-style Llama block, what it holds measured on the CPU
    cpu_check     the planner against this machine's recorded lab runs
    form          the page's form: a grid of answers, looked up in the browser
    cli           the command line
"""
