"""Debugging, exercise 3: a broadcast from two branches that Lockstep accepts."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from distlab.exercises._common import on_ranks, passed, preview, require_callable
from distlab.tools.debug import CollectiveMismatch, Lockstep


def _program_on_rank(program: Callable) -> dict:
    lockstep = Lockstep()
    try:
        held = program(lockstep.wrap(dist.broadcast))
    except CollectiveMismatch as mismatch:
        return {"mismatch": str(mismatch)}
    return {"mismatch": None, "held": held, "calls": lockstep.count}


def check_lockstep_broadcast(program: Callable, nprocs: int = 3) -> None:
    """``program(broadcast)`` runs on every rank with ``broadcast =
    Lockstep().wrap(dist.broadcast)`` and returns the tensor its rank holds afterwards:
    rank 0's weights, on every rank, with no CollectiveMismatch."""
    require_callable(program, "program", "def share_weights(broadcast): ...")
    # CPU ranks even where there are GPUs: the program makes its tensors without a
    # device, and what is checked is the order of calls, which is the same on
    # every backend
    reports = on_ranks(
        functools.partial(_program_on_rank, program),
        nprocs,
        "your program",
        device="cpu",
    )
    if reports[0]["mismatch"]:
        raise AssertionError(
            f"Lockstep stopped your program on {nprocs} ranks: {reports[0]['mismatch']}"
        )
    if reports[0]["calls"] == 0:
        raise AssertionError("your program never called the broadcast it was given")
    weights = reports[0]["held"]
    if not isinstance(weights, torch.Tensor):
        raise AssertionError(
            "your program must return the tensor its rank holds; rank 0 "
            f"returned {weights!r}"
        )
    for rank, report in enumerate(reports[1:], start=1):
        held = report["held"]
        if not (
            isinstance(held, torch.Tensor)
            and held.shape == weights.shape
            and torch.equal(held, weights)
        ):
            shown = preview(held) if isinstance(held, torch.Tensor) else repr(held)
            raise AssertionError(
                f"rank {rank} holds {shown} after your program; rank 0 "
                f"broadcast {preview(weights)}"
            )
    passed(
        f"Lockstep saw the same {reports[0]['calls']} call(s) on all {nprocs} "
        "ranks, and every rank holds "
        f"rank 0's weights exactly"
    )
