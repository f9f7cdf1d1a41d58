"""The data-parallel strategies as data: one row each, read by the memory calculator,
the planner's memory and communication, its recommender and the pages' forms.

    STRATEGIES["fsdp2"].sharded          # ("params", "grads", "optimizer")
    STRATEGIES["fsdp2"].backward         # ("all-gather", "reduce-scatter") per unit

The names are the experiments' (``distlab.infra.experiment``): ``fsdp2`` is ZeRO-3,
``hsdp`` FSDP2 on a (replicate, shard) mesh. Collectives are c10d's kinds, as
``tools.collective_bytes`` counts them on real ranks (book/fsdp_communication.md).
"""

from __future__ import annotations

from dataclasses import dataclass

PARTS = ("params", "grads", "optimizer")


# --- begin strategies ---
@dataclass(frozen=True)
class Strategy:
    label: str
    # the parts of the model state each rank holds 1/shards of
    sharded: tuple[str, ...]
    # over how many ranks: "ranks" (all N) or "group" (g ranks; the N/g groups
    # replicate)
    shards_over: str
    # whole parameters held on top of the shards at the peak: "units" (the root and
    # two blocks: the one computing, the next prefetched), "model", or None
    gathered: str | None
    # collectives per step: in forward (per unit), in backward (per unit, or "buckets"
    # for DDP's all-reduce), after the optimizer step (of the whole model)
    forward: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()
    after_step: tuple[str, ...] = ()


STRATEGIES = {
    "ddp": Strategy("DDP (no sharding)", (), "ranks", None, backward=("all-reduce",)),
    "zero1": Strategy(
        "ZeRO-1: optimizer state",
        ("optimizer",),
        "ranks",
        None,
        backward=("reduce-scatter",),
        after_step=("all-gather",),
    ),
    "zero2": Strategy(
        "ZeRO-2: + gradients",
        ("optimizer", "grads"),
        "ranks",
        None,
        backward=("reduce-scatter",),
        after_step=("all-gather",),
    ),
    "fsdp2": Strategy(
        "ZeRO-3 = FSDP2 fully_shard",
        PARTS,
        "ranks",
        "units",
        forward=("all-gather",),
        backward=("all-gather", "reduce-scatter"),
    ),
    # reshard_after_forward=False: the same shards, and each unit's gathered parameters
    # alive from its forward to its backward, so when backward starts every unit is
    # whole and backward gathers nothing
    "fsdp2-no-reshard": Strategy(
        "FSDP2 reshard_after_forward=False",
        PARTS,
        "ranks",
        "model",
        forward=("all-gather",),
        backward=("reduce-scatter",),
    ),
    "hsdp": Strategy(
        "HSDP: shard in groups of g, replicate across",
        PARTS,
        "group",
        "units",
        forward=("all-gather",),
        backward=("all-gather", "reduce-scatter", "all-reduce"),
    ),
}
# --- end strategies ---


def strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]
