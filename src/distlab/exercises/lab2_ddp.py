"""Lab 2's exercise 3 (load a state dict saved from the DDP wrapper into a plain GPT),
and the rows each rank takes, which the page draws.

    rank_of_rows(8, (1, 2))  # {1: [0, 0, ...], 2: [0, 0, 0, 0, 1, 1, 1, 1]}
    check_loads_ddp_state(load)  # exercise 3's checker
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch

from distlab.exercises._common import on_ranks, passed, rank_device, require_callable
from distlab.infra.experiment import gpt


def rank_of_rows(
    global_batch: int = 8, world_sizes=(1, 2), step: int = 0, seed: int = 1337
) -> dict[int, list[int]]:
    """For each world size N, the rank that ``TokenData.batch`` gives each row of
    ``step``'s global batch: found by matching every rank's rows against the whole
    batch, so the answer is the data code's, not a formula's."""
    from distlab.data import token_data
    from distlab.model import preset

    data, T = token_data(), preset("tiny").block_size
    x, _ = data.global_windows("train", step, global_batch, T, seed)  # (B, T)
    owners = {}
    for world_size in world_sizes:
        owner = [-1] * global_batch
        for rank in range(world_size):
            mine, _ = data.batch("train", step, global_batch, T, seed, rank, world_size)
            for row in range(global_batch):
                if (mine == x[row]).all(dim=1).any():  # row is one of this rank's
                    owner[row] = rank
        owners[world_size] = owner
    return owners


def _cpu_copy(state: dict) -> dict:
    # loadable where there is no GPU
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _ddp_state_dicts() -> dict:
    """What lab 2 would save with ``model.state_dict()`` (the wrapper) and
    ``model.module.state_dict()``."""
    from distlab.parallel import apply_ddp

    model = gpt("tiny", seed=1).to(rank_device())
    ddp = apply_ddp(model, rank_device())
    return {
        "wrapper": _cpu_copy(ddp.state_dict()),
        "inner": _cpu_copy(ddp.module.state_dict()),
    }


@functools.cache
def _saved_by_ddp() -> dict:
    """The two state dicts, saved once per process: a launch costs seconds, and each
    check copies them before the reader's load sees them."""
    # a real DDP wrapper, on one rank
    return on_ranks(_ddp_state_dicts, 1, "saving a DDP model")[0]


def check_loads_ddp_state(load: Callable) -> None:
    """``load(model, state)`` must put a state dict saved from a DDP wrapper (keys
    ``module.*``) into the plain GPT ``model``, every tensor, exactly."""
    require_callable(load, "load", "def load(model, state): ...")
    saved = _saved_by_ddp()
    first_key = next(iter(saved["wrapper"]))
    # other weights than the saved ones: a load that skips a key shows
    model = gpt("tiny", seed=2)
    try:
        load(model, copy.deepcopy(saved["wrapper"]))
    except Exception as error:
        message = " ".join(str(error).split())  # load_state_dict's message spans lines
        raise AssertionError(
            f"your load raised {type(error).__name__}: {message[:240]}... (the "
            f"saved keys look like {first_key!r})"
        ) from error
    loaded = model.state_dict()
    for name, want in saved["inner"].items():
        got = loaded[name]
        if not torch.equal(got, want):
            diff = (got - want).abs().max().item()
            raise AssertionError(
                f"after your load, {name} differs from the saved model's (max "
                f"abs diff {diff:.3g}): "
                "was it skipped (strict=False loads nothing whose key does not match)?"
            )
    passed(  # one line within the book's 88 columns
        f"all {len(saved['inner'])} tensors saved from the DDP wrapper are in the "
        "plain GPT, exactly"
    )
