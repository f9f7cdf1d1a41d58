"""Train the GPT under each data-parallel wrapper, to compare them on equal terms.

Called on every rank (through ``distlab.infra.launch.run_ranks``) or in a single process:

    run_ranks(train_steps, nprocs=2, args=("bucketed",))   # from-scratch DDP on 2 ranks
    train_steps("single")                                  # the one-process reference

Kinds: ``single`` (no wrapper; one process), ``torch`` (torch's DistributedDataParallel),
and the from-scratch ``naive``, ``hooks`` and ``bucketed`` of ``distlab.scratch.ddp``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distlab.data import TokenData, load_corpus
from distlab.model import GPT, preset
from distlab.parallel import apply_ddp
from distlab.runtime import dist_env, pick_device, synchronize
from distlab.scratch.ddp import WRAPPERS

KINDS = ("single", "torch", *WRAPPERS)


def _world() -> tuple[int, int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist_env()[1], dist.get_world_size()
    return 0, 0, 1


def _setup(kind: str, preset_name: str, seed: int, bucket_cap_mb: float):
    """This rank's data, wrapped model and device, and the sequence length."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    data = TokenData(load_corpus())
    device = pick_device("auto", _world()[1])
    model = GPT(preset(preset_name, vocab_size=data.tokenizer.vocab_size), seed=seed).to(device)
    if kind == "torch":
        model = apply_ddp(model, device, bucket_cap_mb=bucket_cap_mb)
    elif kind == "bucketed":
        model = WRAPPERS[kind](model, bucket_cap_mb=bucket_cap_mb)
    elif kind != "single":
        model = WRAPPERS[kind](model)
    return data, model, device, preset(preset_name).block_size


def _finish(model) -> None:
    if hasattr(model, "finish_gradient_sync"):  # the from-scratch wrappers; torch DDP is done
        model.finish_gradient_sync()


def train_steps(
    kind: str,
    preset_name: str = "tiny",
    steps: int = 10,
    global_batch: int = 16,
    seed: int = 1337,
    bucket_cap_mb: float = 25.0,
    lr: float = 1e-3,
) -> dict:
    """``steps`` AdamW steps; returns the global mean loss of each step and its seconds."""
    rank, _, world_size = _world()
    data, model, device, T = _setup(kind, preset_name, seed, bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses, seconds = [], []
    for step in range(steps):
        synchronize(device)
        start = time.perf_counter()
        x, y = data.batch("train", step, global_batch, T, seed, rank, world_size, device)
        _, loss = model(x, y)
        loss.backward()
        _finish(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world_size)
        seconds.append(time.perf_counter() - start)
    return {
        "kind": kind,
        "world_size": world_size,
        "losses": losses,
        "step_s": seconds,
        "tokens_per_s": global_batch * T * max(1, steps - 2) / sum(seconds[2:] or seconds),
    }


def gradients(
    kind: str, preset_name: str = "tiny", global_batch: int = 16, seed: int = 1337, bucket_cap_mb: float = 25.0
) -> list[torch.Tensor]:
    """Every parameter's gradient after one forward/backward and the gradient sync."""
    rank, _, world_size = _world()
    data, model, device, T = _setup(kind, preset_name, seed, bucket_cap_mb)
    x, y = data.batch("train", 0, global_batch, T, seed, rank, world_size, device)
    model(x, y)[1].backward()
    _finish(model)
    return [p.grad.detach().cpu().clone() for p in model.parameters()]
