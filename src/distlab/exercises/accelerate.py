"""Accelerate, exercise 3: lab 6's --fsdp on CPU skips the gradient sync while
micro-batches accumulate."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

from distlab.exercises._common import on_ranks, passed, rank_device, require_callable
from distlab.parallel import FSDP_REDUCE_SCATTER

MICRO_BATCHES = 4
ROWS_PER_MICRO_BATCH = 2


def _lab6_step(accelerator, sync_context: Callable | None) -> dict:
    """One optimizer step of lab 6's train step on the tiny GPT, sharded by hand as lab
    6 does on CPU; ``sync_context`` None is the lab unchanged (a reduce-scatter per
    micro-batch)."""
    from distlab.data import token_data
    from distlab.model import GPT, preset
    from distlab.parallel import apply_fsdp
    from distlab.runtime import rank_world

    rank, n = rank_world()
    cfg = preset("tiny", vocab_size=token_data().vocab_size)
    model = apply_fsdp(GPT(cfg, seed=1).to(rank_device()))  # move first, then shard
    # the model is not Accelerate's
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    rows = MICRO_BATCHES * ROWS_PER_MICRO_BATCH
    x, y = torch.randint(
        0,
        cfg.vocab_size,
        (2, rows * n, cfg.block_size),
        generator=torch.Generator().manual_seed(0),
    ).to(rank_device())
    mine = slice(rank * rows, (rank + 1) * rows)
    # count the reduce-scatters FSDP2 issues (dist.reduce_scatter_single in torch 2.13);
    # the profiler would tell the same, at seconds of overhead per step
    calls = [0]
    original = getattr(dist, FSDP_REDUCE_SCATTER)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    with mock.patch.object(dist, FSDP_REDUCE_SCATTER, counted):
        for xm, ym in zip(
            x[mine].split(ROWS_PER_MICRO_BATCH), y[mine].split(ROWS_PER_MICRO_BATCH)
        ):
            # sets accelerator.sync_gradients on entry
            with accelerator.accumulate(model):
                context = (
                    contextlib.nullcontext()
                    if sync_context is None
                    else sync_context(accelerator, model)
                )
                with context:
                    _, micro_loss = model(xm, ym)
                    accelerator.backward(micro_loss)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), math.inf)
    optimizer.zero_grad(set_to_none=True)
    units = len(model.blocks) + 1  # apply_fsdp: one unit per block, then the root
    return {"reduce_scatters": calls[0], "grad_norm": float(grad_norm), "units": units}


def _both_steps(sync_context: Callable) -> dict:
    from distlab.accel import make_accelerator

    # lab 6's own Accelerator: cpu=True on CPU, micro-batches counted by accumulate()
    accelerator = make_accelerator(
        rank_device(), "fp32", MICRO_BATCHES, False, timeout_s=10, fsdp=True
    )
    return {
        "unchanged": _lab6_step(accelerator, None),
        "yours": _lab6_step(accelerator, sync_context),
    }


def check_skips_sync(sync_context: Callable, nprocs: int = 2) -> None:
    """``sync_context(accelerator, model)``, entered inside
    ``accelerator.accumulate(model)`` around each micro-batch, must make lab 6's CPU
    FSDP2 step reduce-scatter once per unit per optimizer step, with the gradient norm
    of the unchanged step."""
    require_callable(
        sync_context, "sync_context", "def sync_context(accelerator, model): ..."
    )
    steps = on_ranks(
        functools.partial(_both_steps, sync_context),
        nprocs,
        "lab 6's step with your context",
        init_group=False,
    )  # Accelerate starts the process group itself, as in lab 6
    for rank, step in enumerate(steps):
        unchanged, yours = step["unchanged"], step["yours"]
        units, count = unchanged["units"], yours["reduce_scatters"]
        if count == 0:
            raise AssertionError(
                f"rank {rank}: no reduce-scatter ran in the step (gradient norm "
                f"{yours['grad_norm']:.6f}): the last micro-batch must sync; "
                "skip only while "
                "accelerator.sync_gradients is False"
            )
        if count != units:
            raise AssertionError(
                f"rank {rank}: {count} reduce-scatters in one step of "
                f"{MICRO_BATCHES} micro-batches, "
                f"{count / units:g} per unit; expected 1 per unit ({units} in "
                "all; the unchanged lab runs "
                f"{unchanged['reduce_scatters']}, one per unit per micro-batch)"
            )
        off = abs(yours["grad_norm"] - unchanged["grad_norm"]) / unchanged["grad_norm"]
        if off > 1e-6:
            raise AssertionError(
                f"rank {rank}: gradient norm {yours['grad_norm']:.7f} with your "
                "context, "
                f"{unchanged['grad_norm']:.7f} unchanged ({off:.1e} relative, "
                "tolerance 1e-6)"
            )
    step = steps[0]
    passed(
        f"one step of {MICRO_BATCHES} micro-batches on {nprocs} ranks ran "
        f"{step['yours']['reduce_scatters']} "
        "reduce-scatters (1 per unit) instead of "
        f"{step['unchanged']['reduce_scatters']}, and its gradient norm "
        f"{step['yours']['grad_norm']:.7f} equals the unchanged step's to 1e-6 relative"
    )
