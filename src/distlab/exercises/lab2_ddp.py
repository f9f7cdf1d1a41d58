"""Lab 2, exercise 3: load a state dict saved from the DDP wrapper into a plain GPT."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch

from distlab.exercises._common import on_ranks, passed, rank_device, require_callable
from distlab.infra.experiment import gpt


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
    passed(
        f"all {len(saved['inner'])} tensors of a state dict saved from a DDP "
        f"wrapper ({first_key!r}, ...) "
        "are in the plain GPT, exactly"
    )
