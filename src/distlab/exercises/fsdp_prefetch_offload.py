"""FSDP2 prefetching and CPU offload, exercise: explicit prefetching that gathers every
block ahead."""

from __future__ import annotations

from collections.abc import Callable

from distlab.exercises._common import on_ranks, passed, require_callable

N_LAYER = 4  # blocks of the tiny GPT the check runs on
AHEADS = (1, 2)


def verdict(gathers: list[dict], ahead: int, n_layer: int = N_LAYER) -> None:
    """Raise AssertionError unless every block is all-gathered exactly once in forward
    and once in backward, each time at least one unit and at most ``ahead`` units before
    it computes (``gathers``: ``distlab.tools.fsdp_timeline.gather_leads`` rows of
    one step)."""
    for phase in ("forward", "backward"):
        blocks = [g for g in gathers if g["phase"] == phase and g["unit"] != "root"]
        units = sorted(g["unit"] for g in blocks)
        if units != sorted(f"blocks.{i}" for i in range(n_layer)):
            raise AssertionError(
                f"with ahead={ahead} the {phase} all-gathered "
                f"{units or 'no block'}: every block once is expected"
            )
        for g in blocks:
            if g["lead"] == 0:
                raise AssertionError(
                    f"with ahead={ahead}, {g['unit']}'s {phase} all-gather was "
                    f"issued by {g['issued by']}, just "
                    "before it computed: nothing prefetched it (which module's "
                    "prefetch list could hold it?)"
                )
            if g["lead"] > ahead:
                raise AssertionError(
                    f"with ahead={ahead}, {g['unit']}'s {phase} all-gather ran "
                    f"{g['lead']} units ahead "
                    f"({', '.join(g['during'])} computed in between): more than "
                    f"{ahead} blocks in flight"
                )


def _run(set_prefetch_all: Callable) -> dict[int, list[dict]]:
    """On each rank: the tiny GPT of N_LAYER blocks under apply_fsdp, the reader's
    prefetch, one step."""
    from distlab.chapters.fsdp_prefetch_offload import tiny_blocks, traced_step
    from distlab.data import token_data
    from distlab.model import GPT
    from distlab.parallel import apply_fsdp
    from distlab.runtime import rank_world
    from distlab.tools.fsdp_timeline import gather_leads

    rank, world = rank_world()
    cfg = tiny_blocks(N_LAYER)
    x, y = token_data().batch("train", 0, 2 * world, cfg.block_size, 0, rank, world)
    out = {}
    for ahead in AHEADS:
        model = apply_fsdp(GPT(cfg), check_weights=False)
        set_prefetch_all(model, ahead)
        out[ahead] = gather_leads(traced_step(model, x, y)[0])
    return out


def check_set_prefetch_all(set_prefetch_all: Callable) -> None:
    """``set_prefetch_all(model, ahead)`` sets explicit prefetching on a model sharded
    by ``apply_fsdp`` so that every block, in forward and in backward, is all-gathered
    at least one and at most ``ahead`` units before it computes; checked on 2 ranks for
    ahead = 1 and 2."""
    require_callable(
        set_prefetch_all, "set_prefetch_all", "def set_prefetch_all(model, ahead): ..."
    )
    ranks = on_ranks(
        lambda: _run(set_prefetch_all), nprocs=2, what="set_prefetch_all", timeout=90
    )
    for ahead in AHEADS:
        verdict(ranks[0][ahead], ahead)
    passed(
        f"every block of {N_LAYER} all-gathered 1 to `ahead` units early, both "
        "ways, for ahead = 1 and 2"
    )
