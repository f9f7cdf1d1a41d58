"""What a reader keeps using after the book, one instrument a module. May import the
training library, ``costs``, ``infra`` and ``planner``.

    debug             Lockstep, check_replicas, the flight-recorder analyser
    triage            from a failing job's symptom to the tool that finds the cause
    runs              the run-log CLI (``python -m distlab.tools.runs``)
    stragglers        the slow rank, from per-rank step times gathered every k steps
    collective_lanes  the collectives each rank ran, in order, and who issued each
    collective_bytes  the bytes of every c10d collective, from Python or C++
    comm_bytes        the bytes a rank hands to ``all_reduce``, from any thread
    comm_timeline     when each DDP bucket was ready, launched and done
    bucket_firing     which bucket DDP launched after which gradient
    ddp_compile       how Dynamo's DDPOptimizer split a compiled DDP graph
    fsdp_timeline     FSDP2's gathered bytes after every operator, and who gathered
    ac_timeline       a step's forward, recompute and backward, with the bytes alive
    offload           an activation offload hook, and a meter of what offload moves
    dtypes            which dtype each operator really ran in
    sharding          an ``IterableDataset`` split by rank x DataLoader worker
    exact_eval        an evaluation that counts every sample exactly once
    lr_scaling        learning-rate rules for a global batch that grows with ranks
    step_model        a DDP step from your numbers: the batch that hides the all-reduce
    memory_calculator bytes per rank under DDP, ZeRO-1/2/3, FSDP2, HSDP
    memory_checks     what the calculator is checked against (ZeRO paper, real ranks)
    calculator_page   the memory calculator as a form and as ipywidgets
    big_model         Accelerate's device map for inference on a memory budget
    plan              ``python -m distlab.tools.plan``: the planner's first address
"""
