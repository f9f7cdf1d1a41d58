"""DDP in practice: uneven inputs and ``Join``, the buffers DDP broadcasts, BatchNorm
under DDP, exact distributed evaluation.

The experiments of book/ddp_in_practice.md. The ``*_demo`` functions run on every rank
(2 gloo ranks on the page, all in one launch: ``practice_runs``); the ``*_reference``
functions compute the same thing in one process, for the tests and the page to
compare with. What DDP and Join issue is recorded by the process group's flight
recorder and tagged with the call that issued it (``distlab.tools.collective_lanes``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.infra.observe import caught, stuck
from distlab.runtime import init_distributed, rank_world
from distlab.scratch.sync_batchnorm import (
    convert_sync_batchnorm_on_gloo,
    torch_refusals,
)
from distlab.tools.collective_lanes import (
    CollectiveLog,
    enable_flight_recorder,
    recorded,
    tag_ddp_join,
    untagged,
)
from distlab.tools.exact_eval import eval_data, naive_evaluations

ROWS = 4  # rows per rank per step, in the uneven-inputs and BatchNorm demos
TRUE_W = torch.tensor([[1.0], [-2.0], [0.5]])


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


# ---------------------------------------------------------------- uneven inputs
def uneven_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows at ``step``: a pure function of the two, so one process can
    redo them."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, 3, generator=gen)  # (ROWS, 3)
    return x, x @ TRUE_W + 0.1 * torch.randn(ROWS, 1, generator=gen)  # (ROWS, 1)


def regressor() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Linear(3, 1)


class RankCounter(nn.Module):
    """The regressor, and a buffer that every forward changes differently on every
    rank (rank r adds r + 1): where a broadcast came from shows in its value."""

    def __init__(self, buffer_numel: int = 5):
        super().__init__()
        self.linear = regressor()
        # 5 numbers: its broadcasts are easy to spot among the others
        self.register_buffer("seen", torch.zeros(buffer_numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += rank_world()[0] + 1
        return self.linear(x)


# --- begin uneven ---
def uneven_demo(
    report: str,
    steps_per_rank: list[int],
    join: bool,
    divide_by_initial_world_size: bool = True,
    idle_s: float = 0.0,
    module=regressor,
    instrument=None,
) -> dict:
    """Rank r trains ``steps_per_rank[r]`` steps of DDP, inside ``Join`` or not."""
    rank, _ = rank_world()
    model = DDP(module())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if instrument:  # the page's flight-recorder tags
        instrument(model, opt)
    context = (
        Join([model], divide_by_initial_world_size=divide_by_initial_world_size)
        if join
        else contextlib.nullcontext()
    )
    grads, done, left_loop = [], 0, None
    with caught(report) as failed, context:
        for step in range(steps_per_rank[rank]):
            x, y = uneven_batch(step, rank)
            opt.zero_grad()
            # the gradient all-reduce: every rank must be here
            F.mse_loss(model(x), y).backward()
            grads.append(flat(p.grad for p in model.parameters()))
            opt.step()
            done += 1
        left_loop = flat(model.parameters())  # when this rank ran out of data
    if failed.error is None and not join:
        stuck(idle_s)  # the rank with less data goes on to other work
    return {
        "steps": done,
        "grads": grads,
        "left_loop": left_loop,
        "weights": flat(model.parameters()),
        "error": failed.error,
        "waited_s": failed.waited_s,
    }


# --- end uneven ---


def uneven_reference(
    steps_per_rank: list[int],
    divide_by_initial_world_size: bool = True,
    lr: float = 0.1,
    stale: tuple[int, ...] = (),
) -> dict:
    """One process, the same rows: at each step the rows of the ranks that still
    have data, the loss divided by every rank's rows (``divide_by_initial_world_size``:
    the missing rows count zero) or by the rows present. ``stale``: parameters whose
    gradient, once a rank has run out, is that of the last step every rank took."""
    model, world_size = regressor(), len(steps_per_rank)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads, last_full = [], {}
    for step in range(max(steps_per_rank)):
        x, y = (
            torch.cat(t)
            for t in zip(
                *[
                    uneven_batch(step, r)
                    for r in range(world_size)
                    if step < steps_per_rank[r]
                ]
            )
        )
        rows = ROWS * world_size if divide_by_initial_world_size else len(x)
        opt.zero_grad()
        (F.mse_loss(model(x), y, reduction="sum") / rows).backward()
        params = list(model.parameters())
        if step < min(steps_per_rank):
            last_full = {i: params[i].grad.clone() for i in stale}
        else:
            for i in stale:
                params[i].grad = last_full[i]
        grads.append(flat(p.grad for p in params))
        opt.step()
    return {"grads": grads, "weights": flat(model.parameters())}


# --- begin zero ---
def zero_demo(steps_per_rank: list[int]) -> dict:
    """The uneven run with ZeRO-1: each rank steps its shard of the parameters and
    broadcasts it; the optimizer is a second joinable."""
    rank, _ = rank_world()
    model = DDP(regressor())
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1
    )
    with Join([model, opt]):
        for step in range(steps_per_rank[rank]):
            x, y = uneven_batch(step, rank)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()  # this rank's shard, then a broadcast of every shard
    mine = {id(p) for p in opt.optim.param_groups[0]["params"]}
    return {
        "weights": flat(model.parameters()),
        "shard": [i for i, p in enumerate(model.parameters()) if id(p) in mine],
    }


# --- end zero ---


# ---------------------------------------------------------------- the lane diagram
def lanes_demo(report: str, steps_per_rank: list[int], module=regressor) -> dict:
    """The ``Join`` run with every collective recorded and tagged; the buffers of
    each rank after each of its steps."""
    log, buffers = CollectiveLog(), []

    def instrument(model, opt):
        log.start = len(recorded())  # after DDP's construction
        tag_ddp_join(log, model)
        step = opt.step

        def step_and_read(*args, **kwargs):
            out = step(*args, **kwargs)
            buffers.append([b[0].item() for b in model.module.buffers()])
            return out

        opt.step = step_and_read
        log.tag(opt, "step", "", ends_phase="step {n}")

    try:
        out = uneven_demo(
            report, steps_per_rank, True, module=module, instrument=instrument
        )
    finally:
        log.restore()
    log.mark("end")
    return {**out, "phases": log.phases(untagged), "buffers": buffers}


# ---------------------------------------------------------------- buffers
FORWARDS = ("train",) * 3 + ("no_grad",) * 2 + ("train",) * 2 + ("no_sync", "train")
BUFFER_SETTINGS = {
    "forward_sync_buffers=True": {},  # the default
    "forward_sync_buffers=False": {"forward_sync_buffers": False},
    "broadcast_buffers=False": {"broadcast_buffers": False},  # deprecated in 2.13
}


# --- begin buffer_sync ---
def buffer_broadcasts(forwards: tuple[str, ...] = FORWARDS) -> dict[str, list[dict]]:
    """On every rank, for each setting: DDP around ``RankCounter``, built, then run
    for ``forwards`` (a training step; a forward under ``no_grad``; a training step
    inside ``no_sync()``). For the construction and each forward: the numbers
    broadcast, the broadcasts of the buffer alone, and this rank's buffer."""
    out = {}
    for setting, kwargs in BUFFER_SETTINGS.items():
        log = CollectiveLog()
        with warnings.catch_warnings():  # broadcast_buffers: a FutureWarning
            warnings.simplefilter("ignore", FutureWarning)
            model = DDP(RankCounter(), **kwargs)
        log.mark("construction")
        seen = [model.module.seen[0].item()]
        for kind in forwards:
            sync = model.no_sync() if kind == "no_sync" else contextlib.nullcontext()
            with sync, torch.set_grad_enabled(kind != "no_grad"):
                loss = model(torch.ones(4, 3)).sum()
                if kind != "no_grad":
                    loss.backward()
            log.mark(kind)
            seen.append(model.module.seen[0].item())
        buffer = model.module.seen.numel()
        out[setting] = [
            {
                "call": phase,
                "numbers broadcast": sum(n for k, n, _ in rows if k == "broadcast"),
                "of the buffer": sum(
                    k == "broadcast" and n == buffer for k, n, _ in rows
                ),
                "buffer": value,
            }
            for (phase, rows), value in zip(log.phases(lambda kind: ""), seen)
        ]
        del model  # freed while the group lives (the debugging chapter's exit order)
    return out


# --- end buffer_sync ---


# ---------------------------------------------------------------- BatchNorm
def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def bn_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ROWS rows per rank; rank r takes rows [r*ROWS,
    (r+1)*ROWS)."""
    gen = torch.Generator().manual_seed(step)
    x = 2 * torch.randn(ROWS * world_size, 4, generator=gen) + 1  # (B, 4)
    # (B, 1)
    return x, x[:, :1] * x[:, 1:2] + torch.randn(ROWS * world_size, 1, generator=gen)


# an input for eval-mode outputs, which use the running stats
PROBE = torch.linspace(-2, 2, 12).view(3, 4)


def _steps(model, opt, batches, runner=None) -> dict:
    """Train on ``batches`` (through ``runner``, a DDP wrapper, if given); the gradient
    of the first step, where the model ends, and its eval-mode output on PROBE."""
    forward = runner or model
    first = None
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(forward(x), y).backward()
        first = first if first is not None else flat(p.grad for p in model.parameters())
        opt.step()
    forward.eval()
    with torch.no_grad():
        # under DDP with forward_sync_buffers, this forward broadcasts rank 0's buffers
        probe = forward(PROBE)
    bn = next(
        m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    )
    return {
        "grad0": first,
        "weights": flat(model.parameters()),
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
        "probe": probe,
    }


# --- begin batchnorm ---
def bn_demo(
    forward_sync_buffers: bool = True,
    sync: bool = False,
    steps: int = 3,
    lr: float = 0.1,
) -> dict:
    """Rank r trains the BatchNorm model under DDP on its ROWS rows of each
    global batch."""
    rank, world_size = rank_world()
    module = convert_sync_batchnorm_on_gloo(bn_model()) if sync else bn_model()
    # this rank's own gradient of step 0, before DDP averages it (a copy: its forward
    # moves running stats)
    local = copy.deepcopy(module)
    x, y = bn_batch(0, world_size)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    F.mse_loss(local(x[mine]), y[mine]).backward()
    mean_of_local = flat(p.grad for p in local.parameters()) / world_size
    dist.all_reduce(mean_of_local)
    ddp = DDP(module, forward_sync_buffers=forward_sync_buffers)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    out = _steps(
        module,
        opt,
        [
            (x[mine], y[mine])
            for x, y in (bn_batch(s, world_size) for s in range(steps))
        ],
        ddp,
    )
    ddp.train()
    x, y = bn_batch(steps, world_size)
    # after a no_grad forward DDP skips one buffer broadcast
    F.mse_loss(ddp(x[mine]), y[mine]).backward()
    with CommDebugMode() as fwd:  # one more step, its collectives counted
        loss = F.mse_loss(ddp(x[mine]), y[mine])
    with CommDebugMode() as bwd:
        loss.backward()
    counts = {
        f"{phase} {str(op).split('.')[-1].rstrip('_')}": n
        for phase, mode in (("forward", fwd), ("backward", bwd))
        for op, n in mode.get_comm_counts().items()
    }
    return {**out, "mean_of_local": mean_of_local, "collectives": counts}


# --- end batchnorm ---


def bn_reference(steps: int = 3, lr: float = 0.1, world_size: int = 2) -> dict:
    """One process with the whole global batch of every step."""
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return _steps(model, opt, [bn_batch(s, world_size) for s in range(steps)])


# ---------------------------------------------------------------- one launch
STEPS = [4, 3]  # batches on rank 0, rank 1


def practice_runs(report: str) -> dict:
    """Every experiment of the page that runs on healthy ranks, on every rank of one
    launch (``run_ranks(..., init_group=False)``): the group is made here, with the
    flight recorder on."""
    enable_flight_recorder()
    init_distributed(torch.device("cpu"), timeout_s=30)
    try:
        return {
            "lanes": lanes_demo(report, STEPS),  # Join, divide_by_initial_world_size
            "no_divide": uneven_demo(report, STEPS, True, False),
            "lanes_buffers": lanes_demo(report, STEPS, RankCounter),
            "zero": zero_demo(STEPS),
            "buffers": buffer_broadcasts(),
            "bn": {
                "default": bn_demo(),
                "forward_sync_buffers=False": bn_demo(forward_sync_buffers=False),
                "synchronised": bn_demo(sync=True),
                "torch SyncBatchNorm on CPU": torch_refusals(),
            },
            "eval": naive_evaluations(*eval_data(5)),
        }
    finally:
        # free every DDP model while its group lives: one freed after the group is
        # destroyed can deadlock gloo (the debugging chapter's "exit order")
        gc.collect()
        dist.destroy_process_group()
