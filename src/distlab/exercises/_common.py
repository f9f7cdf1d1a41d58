"""What every checker shares: run the reader's code on ranks, and say how it went in
one line."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import torch

from distlab.infra.launch import LaunchTimeout, RankFailed, run_ranks


def passed(message: str) -> None:
    """What a checker prints when the reader's code does what the exercise asks,
    wrapped to the book's 88-column reading width."""
    print(textwrap.fill(f"passed: {message}", width=88, subsequent_indent="  "))


def on_ranks(
    fn: Callable,
    nprocs: int,
    what: str,
    timeout: float = 60,
    pg_timeout: float = 10,
    init_group: bool = True,
    device: str = "cpu",
) -> list:
    """``run_ranks`` for a checker: the reader's code may raise or wait forever in
    a collective.

    The ranks run on the CPU over gloo by default, as the book's pages do, on a machine
    with GPUs too (``run_ranks``' ``device``).

    A short process-group timeout turns a collective that one rank never joins into an
    error after ``pg_timeout`` seconds, and ``timeout`` kills everything else that runs
    too long; both come back as an AssertionError that names the rank and the cause.
    """
    try:
        return run_ranks(
            fn,
            nprocs=nprocs,
            timeout=timeout,
            pg_timeout=pg_timeout,
            init_group=init_group,
            device=device,
            quiet=True,
        )
    except LaunchTimeout:
        raise AssertionError(
            f"{what} did not finish on {nprocs} ranks within {timeout:.0f} s; "
            "every rank was killed"
        ) from None
    except RankFailed as failure:
        hint = ""
        if "Timed out" in failure.summary:
            hint = " (a rank waited for a collective that another rank never called)"
        elif any(
            sign in failure.summary
            for sign in ("SIGABRT", "Connection closed", "Connection reset")
        ):
            hint = (
                " (the ranks' collectives did not pair up: one rank called one the "
                "others did not, or stopped early)"
            )
        # the rank's traceback travels in the chained RankFailed
        raise AssertionError(
            f"{what} failed on {nprocs} ranks: rank {failure.rank}: "
            f"{failure.summary}{hint}"
        ) from failure


def rank_device() -> torch.device:
    """This rank's device, as the labs choose it: ``pick_device("auto")``, so the CPU on
    the checkers' default CPU ranks (``DISTLAB_DEVICE=cpu``), a GPU per rank with
    ``device="cuda"``."""
    from distlab.runtime import dist_env, pick_device

    return pick_device("auto", dist_env()[1])


def preview(t: torch.Tensor, k: int = 6) -> str:
    """The first ``k`` values of a tensor, short enough for a one-line message."""
    values = t.detach().flatten()[:k].tolist()
    return (
        "[" + ", ".join(f"{v:g}" for v in values) + (", ...]" if t.numel() > k else "]")
    )


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: one number for how far a whole tensor is off."""
    return (
        (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
    ).item()


def require_callable(obj, name: str, example: str) -> None:
    if not callable(obj):
        raise ValueError(
            f"{name} must be a function, e.g. {example}; got {type(obj).__name__}"
        )
