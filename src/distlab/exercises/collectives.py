"""Collectives, exercise 3: an all-reduce built from a reduce-scatter and
an all-gather."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from distlab.exercises._common import (
    on_ranks,
    passed,
    preview,
    rank_device,
    require_callable,
)


def _cases(rank: int, n: int) -> dict[str, torch.Tensor]:
    # integer values: float sums are then exact in any order, so "equal" means equal
    gen = torch.Generator().manual_seed(100 + rank)  # different values on every rank
    return {
        f"a 1-D float32 tensor of {4 * n} elements": torch.randint(
            -50, 50, (4 * n,), generator=gen
        ).float(),
        f"a 2-D float32 tensor of shape (2, {3 * n})": torch.randint(
            -50, 50, (2, 3 * n), generator=gen
        ).float(),
    }


def _all_reduce_on_rank(all_reduce: Callable) -> list[dict]:
    """Each case: what the reader's all_reduce left in its input, next to
    dist.all_reduce's sum."""
    reports = []
    for case, t in _cases(dist.get_rank(), dist.get_world_size()).items():
        t = t.to(rank_device())  # NCCL ranks only take GPU tensors
        expected = t.clone()
        dist.all_reduce(expected)
        returned = all_reduce(t)
        reports.append(
            {
                "case": case,
                "holds": t.cpu(),
                "expected": expected.cpu(),
                "returned_the_sum": isinstance(returned, torch.Tensor)
                and returned is not t
                and returned.shape == expected.shape
                and torch.equal(returned, expected),
            }
        )
    return reports


def check_all_reduce(
    all_reduce: Callable, world_sizes: tuple[int, ...] = (2, 3)
) -> None:
    """``all_reduce(t)`` must leave in ``t``, on every rank, the sum of all ranks'
    ``t``, in place as ``dist.all_reduce`` does. Compared with ``dist.all_reduce`` on 2
    and 3 ranks."""
    require_callable(all_reduce, "all_reduce", "def all_reduce(t): ...")
    for n in world_sizes:
        reports = on_ranks(
            functools.partial(_all_reduce_on_rank, all_reduce), n, "your all_reduce"
        )
        for rank, cases in enumerate(reports):
            for r in cases:
                if torch.equal(r["holds"], r["expected"]):
                    continue
                if r["returned_the_sum"]:
                    raise AssertionError(
                        f"on {n} ranks, rank {rank}: your all_reduce returned "
                        "the sum in a new tensor but left "
                        f"its input unchanged ({r['case']}); an all-reduce "
                        "works in place, as dist.all_reduce does"
                    )
                diff = (r["holds"] - r["expected"]).abs().max().item()
                raise AssertionError(
                    f"on {n} ranks, rank {rank} holds {preview(r['holds'])} "
                    "after your all_reduce of "
                    f"{r['case']}; expected the sum over ranks "
                    f"{preview(r['expected'])}, max abs diff {diff:g}"
                )
    ranks = " and ".join(map(str, world_sizes))
    # two lines within the page's 88 columns
    passed(
        f"your all_reduce equals dist.all_reduce on {ranks} ranks,\n  in place, "
        "for 1-D and 2-D float32 tensors of integers (so no rounding)"
    )
