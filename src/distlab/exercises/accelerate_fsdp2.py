"""Accelerate's FSDP2 configuration, exercise 3: a check, run after ``prepare``, that
catches an optimizer that does not step every parameter of the model exactly once."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

from distlab.exercises._common import on_ranks, passed, require_callable

# setup of the chapter's LOADING_SETUPS -> which ranks' optimizers are wrong
# after prepare
EXPECTED = {
    "rank 0 reads, others empty": (),  # the recipe: right everywhere
    # lm_head split off wte, not in the optimizer
    "rank 0 reads, others empty, no tie_weights": (0, 1),
    "rank 0 reads, others on meta": (1,),  # rank 1's optimizer: one parameter, 28 times
}


def problems_on_this_rank(find_problems: Callable, env: dict, checkpoint: str) -> dict:
    """On one rank: ``find_problems(model, optimizer)`` after ``prepare`` in each setup
    of ``EXPECTED``."""
    from distlab.chapters.accelerate_fsdp2 import (
        LOADING_SETUPS,
        model_before_prepare,
        prepared_model,
    )

    found = {}
    for setup in EXPECTED:
        efficient, others, tie = LOADING_SETUPS[setup]
        setup_env = dict(env, FSDP_CPU_RAM_EFFICIENT_LOADING=str(efficient).lower())
        _, model, optimizer = prepared_model(
            setup_env, model_before_prepare(checkpoint, others, tie)
        )
        problems = find_problems(model, optimizer)
        if not isinstance(problems, (list, tuple)) or not all(
            isinstance(p, str) for p in problems
        ):
            raise TypeError(
                f"find_problems must return a list of strings, got {problems!r}"
            )
        found[setup] = list(problems)
    return found


def check_optimizer_problems(find_problems: Callable, nprocs: int = 2) -> None:
    """``find_problems(model, optimizer)`` must return ``[]`` when the optimizer holds
    every parameter of the prepared model once, and a non-empty list of messages
    otherwise; it runs on each rank after Accelerate's FSDP2 ``prepare`` in three of the
    chapter's loading setups."""
    from distlab.chapters.accelerate_fsdp2 import (
        MINIMAL_CONFIG,
        launcher_env,
        save_checkpoint,
    )

    require_callable(
        find_problems, "find_problems", "def find_problems(model, optimizer): return []"
    )
    with tempfile.TemporaryDirectory(prefix="accelerate-fsdp2-") as tmp:
        Path(tmp, "fsdp2.yaml").write_text(MINIMAL_CONFIG)
        env, checkpoint = (
            launcher_env(Path(tmp, "fsdp2.yaml")),
            str(Path(tmp, "model.pt")),
        )
        save_checkpoint(checkpoint)
        ranks = on_ranks(
            functools.partial(problems_on_this_rank, find_problems, env, checkpoint),
            nprocs,
            "your find_problems after Accelerate's FSDP2 prepare",
            timeout=120,
            # Accelerate makes the process group, as under its launcher
            init_group=False,
        )
    passed(verdict(ranks))


def verdict(ranks: list[dict]) -> str:
    """What each rank's ``find_problems`` said in each setup, judged: the one-line
    message of a pass, or an AssertionError naming the first setup and rank it
    got wrong."""
    for setup, wrong_ranks in EXPECTED.items():
        for rank, found in enumerate(ranks):
            problems = found[setup]
            if rank in wrong_ranks and not problems:
                raise AssertionError(
                    f"{setup!r}, rank {rank}: the optimizer does not step every "
                    "parameter once "
                    "(compare the parameters it holds with "
                    "model.named_parameters()), but find_problems returned []"
                )
            if rank not in wrong_ranks and problems:
                raise AssertionError(
                    f"{setup!r}, rank {rank}: every parameter is in the "
                    "optimizer once, but find_problems "
                    f"returned {problems[:3]}"
                )
    untied = ranks[0]["rank 0 reads, others empty, no tie_weights"]
    meta = ranks[1]["rank 0 reads, others on meta"]
    return (
        "find_problems is silent on the recipe and reports the untied lm_head "
        f"({untied[0]!r}) and rank 1's "
        f"collapsed optimizer ({meta[0]!r}) on {len(ranks)} ranks"
    )
