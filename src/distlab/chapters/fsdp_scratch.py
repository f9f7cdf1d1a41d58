"""The FSDP-from-scratch chapter's experiments: the from-scratch FSDP of ``distlab.scratch.fsdp``
trained beside torch's ``fully_shard`` and one process, and what its event trace says.

    run_ranks(compare, nprocs=2, args=(10,))   # each variant's losses, state bytes, trace
    train("single", steps=10)                  # the one-process reference (distlab.infra.experiment)
"""

from __future__ import annotations

from distlab.infra.experiment import WrapOptions, train
from distlab.scratch.fsdp import Event

# from scratch, freeing each block after its forward (ZeRO-3) and keeping it; then FSDP2
VARIANTS = ("fsdp-scratch", "fsdp-scratch-no-reshard", "fsdp2")


def compare(steps: int = 10, global_batch: int = 16, seed: int = 1337) -> dict[str, dict]:
    """On every rank: each of ``VARIANTS`` trained on the tiny GPT, the same batches from the
    same weights (``experiment.train``). Each result has the global mean loss of every step,
    this rank's state bytes after the first step and, from scratch, the last step's events."""
    runs = {}
    for strategy in VARIANTS:
        trace: list[Event] | None = [] if strategy.startswith("fsdp-scratch") else None
        result = train(strategy, "tiny", steps, global_batch, seed, options=WrapOptions(trace=trace))
        runs[strategy] = {**result, "trace": trace}
    return runs


def gathered_bytes(trace: list[Event]) -> dict[str, int]:
    """Bytes of gathered (full) parameters when forward ends, at most during backward, at the end."""
    end_of_forward = next(e for e in trace if e.unit == "root" and e.what == "forward")
    backward = [e.gathered_bytes for e in trace if e.start >= end_of_forward.end]
    return {
        "end_of_forward": end_of_forward.gathered_bytes,
        "backward_max": max(backward),
        "after_backward": trace[-1].gathered_bytes,
    }
