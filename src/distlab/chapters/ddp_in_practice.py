"""DDP in practice: uneven inputs and ``Join``, BatchNorm under DDP, exact
distributed evaluation.

The experiments of book/ddp_in_practice.md. The ``*_demo`` functions run on every rank
of a ``run_ranks`` or ``observe`` launch (2 gloo ranks on the page); the ``*_reference``
functions compute the same thing in one process, for the tests and the page to
compare with.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from distlab.infra.observe import caught, stuck
from distlab.runtime import rank_world
from distlab.scratch.sync_batchnorm import convert_sync_batchnorm_on_gloo

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


# --- begin uneven ---
def uneven_demo(
    report: str,
    steps_per_rank: list[int],
    join: bool,
    divide_by_initial_world_size: bool = True,
    idle_s: float = 0.0,
    lr: float = 0.1,
) -> dict:
    """Rank r trains ``steps_per_rank[r]`` steps of DDP, inside ``Join`` or not."""
    rank, _ = rank_world()
    model = DDP(regressor())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    shadowed = []  # the backward passes this rank shadowed after it ran out of data
    real_match = model._match_all_reduce_for_bwd_pass
    model._match_all_reduce_for_bwd_pass = lambda: (shadowed.append(1), real_match())
    context = (
        Join([model], divide_by_initial_world_size=divide_by_initial_world_size)
        if join
        else contextlib.nullcontext()
    )
    grads, done, left_loop, counted = [], 0, None, CommDebugMode()
    with caught(report) as failed, context:
        for step in range(steps_per_rank[rank]):
            x, y = uneven_batch(step, rank)
            opt.zero_grad()
            # step 2's collectives are counted: step 1 also broadcasts DDP's rebuilt
            # buckets, once
            with counted if step == 2 else contextlib.nullcontext():
                # the gradient all-reduce: every rank must be here
                F.mse_loss(model(x), y).backward()
            grads.append(flat(p.grad for p in model.parameters()))
            opt.step()
            done += 1
        # the weights when this rank ran out of data
        left_loop = flat(model.parameters())
    if failed.error is None and not join:
        # the rank with less data goes on to other work (a checkpoint, say)
        stuck(idle_s)
    return {
        "steps": done,
        "shadowed": len(shadowed),
        "grads": grads,
        "left_loop": left_loop,
        "weights": flat(model.parameters()),
        "error": failed.error,
        "waited_s": failed.waited_s,
        "step_collectives": {
            str(op).split(".")[-1]: n for op, n in counted.get_comm_counts().items()
        },
    }


# --- end uneven ---


def uneven_reference(
    steps_per_rank: list[int],
    divide_by_initial_world_size: bool = True,
    lr: float = 0.1,
) -> dict:
    """One process, the same rows: at each step the rows of the ranks that still
    have data.

    ``divide_by_initial_world_size``: a step's loss is divided by every rank's rows
    (``ROWS * world_size``), as if the missing ranks' rows counted zero; else by the
    rows present.
    """
    model, world_size = regressor(), len(steps_per_rank)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
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
        grads.append(flat(p.grad for p in model.parameters()))
        opt.step()
    return {"grads": grads, "weights": flat(model.parameters())}


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
        # under DDP with broadcast_buffers, this forward broadcasts rank 0's buffers
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
    broadcast_buffers: bool = True, sync: bool = False, steps: int = 3, lr: float = 0.1
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
    ddp = DDP(module, broadcast_buffers=broadcast_buffers)
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


def torch_sync_batchnorm_on_cpu() -> dict[str, str]:
    """What torch's own SyncBatchNorm does with CPU tensors on a gloo group: each
    attempt, one line."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(bn_model())
    out = {"converted": type(model[1]).__name__}
    for name, attempt in (
        ("forward", lambda: model(bn_batch(0, 1)[0])),
        ("DDP(model)", lambda: DDP(model)),
    ):
        try:
            attempt()
            out[name] = "ran"
        except ValueError as err:
            out[name] = f"ValueError: {err}"
    return out


# ---------------------------------------------------------------- exact evaluation
def per_sample_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error of each sample, (B,)."""
    return (model(x) - y).pow(2).sum(1)


# --- begin exact ---
@torch.no_grad()
def evaluate_exactly(model: nn.Module, dataset, batch_size: int = 2) -> float:
    """The mean loss over every sample of ``dataset`` exactly once, the same on
    every rank.

    The shards are DistributedSampler's (shuffle off, padded: every rank runs the same
    number of batches, which a model whose forward has collectives needs); the padding
    is masked out.
    """
    rank, world_size = rank_world()
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=False
    )
    indices = list(sampler)
    # (sum of losses, samples): float64 keeps counts exact
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        x, y = (torch.stack(t) for t in zip(*[dataset[i] for i in batch]))
        # rank r holds positions r, r + N, r + 2N, ... of the padded order; those past
        # the end are repeats
        real = torch.tensor(
            [rank + (start + j) * world_size < len(dataset) for j in range(len(batch))]
        )
        total[0] += per_sample_loss(model, x, y)[real].sum().double()
        total[1] += real.sum()
    dist.all_reduce(total)  # one collective, after the loop
    return (total[0] / total[1]).item()


# --- end exact ---


@torch.no_grad()
def naive_evaluations(
    model: nn.Module, dataset, batch_size: int = 2
) -> dict[str, float]:
    """The usual mistakes, on every rank: the mean of the ranks' means over padded
    shards, the sum and count over padded shards, and the same with ``drop_last``."""
    rank, world_size = rank_world()
    out = {}
    for name, drop_last in (("padded", False), ("drop_last", True)):
        idx = list(
            DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=False,
                drop_last=drop_last,
            )
        )
        losses = per_sample_loss(
            model, *(torch.stack(t) for t in zip(*[dataset[i] for i in idx]))
        )
        totals = torch.tensor(
            [losses.mean().item(), losses.sum().item(), len(idx)], dtype=torch.float64
        )
        dist.all_reduce(totals)
        out[f"mean of rank means, {name}"] = (totals[0] / world_size).item()
        out[f"sum / count, {name}"] = (totals[1] / totals[2]).item()
    out["exact"] = evaluate_exactly(model, dataset, batch_size)
    return out


def eval_data(n: int) -> tuple[nn.Module, torch.utils.data.TensorDataset]:
    """A fixed regressor and ``n`` samples whose losses differ a lot (so a
    repeat shows)."""
    torch.manual_seed(0)
    x = torch.randn(n, 3)
    return regressor(), torch.utils.data.TensorDataset(
        x, x @ TRUE_W + torch.arange(n, dtype=torch.float32)[:, None]
    )


def one_process_mean(model: nn.Module, dataset) -> float:
    with torch.no_grad():
        return per_sample_loss(model, *dataset.tensors).double().mean().item()
