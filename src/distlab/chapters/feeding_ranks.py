"""Feeding the ranks: which samples each rank sees, how they get there, and
their randomness.

Used by the chapter "Feeding the ranks" and checked by its tests:

* ``DistributedSampler`` as it really behaves: ``sampler_epochs`` runs PyTorch's own
  sampler for every rank (``num_replicas`` and ``rank`` passed, no process group), and
  ``expected_shards`` is the same rule written out by hand, to hold the two against
  each other.
* Two strategies for the book's token data, measured on real ranks: every rank cuts its
  own rows of the global batch (``own_shard``, as the labs do), or rank 0 scatters them.
* Seeds per rank (``seeds_on_ranks``), DataLoader workers' seeds (``SeedProbe``) and an
  ``IterableDataset`` read by rank x worker (``samples_read``), run inside the ranks.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from distlab.data import TokenData, token_data
from distlab.runtime import dist_env, pick_device, rank_world, synchronize


# --------------------------------------------------------------- DistributedSampler
@dataclass(frozen=True)
class SamplerLayout:
    per_rank: int  # indices each rank yields per epoch: len(sampler)
    # per_rank * world_size: indices handed out per epoch, all ranks together
    total: int
    padded: int  # indices repeated to reach total (drop_last=False)
    dropped: int  # indices left out of the epoch (drop_last=True)


def expected_layout(n: int, world_size: int, drop_last: bool) -> SamplerLayout:
    """The sizes DistributedSampler settles on, from the rule alone."""
    if drop_last:
        per_rank = n // world_size  # round down: the tail of the order is cut off
    else:
        per_rank = -(-n // world_size)  # round up: the order is padded from its start
    total = per_rank * world_size
    return SamplerLayout(
        per_rank, total, padded=max(0, total - n), dropped=max(0, n - total)
    )


def epoch_order(n: int, epoch: int, shuffle: bool = True, seed: int = 0) -> list[int]:
    """The order all ranks agree on before sharding: a permutation seeded by seed
    + epoch."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(
        n, generator=torch.Generator().manual_seed(seed + epoch)
    ).tolist()


def expected_shards(
    order: list[int], world_size: int, drop_last: bool
) -> list[list[int]]:
    """DistributedSampler's rule written out: pad or cut ``order``, then deal it out.

    Without drop_last the order is padded by repeating it from its start (cycling when
    more than len(order) are missing); with drop_last its tail is cut. Rank r then takes
    positions r, r + N, r + 2N, ...: a strided deal, not a contiguous block.
    """
    layout = expected_layout(len(order), world_size, drop_last)
    full = list(order)
    while len(full) < layout.total:
        full += order[: layout.total - len(full)]
    full = full[: layout.total]
    return [full[r::world_size] for r in range(world_size)]


def sampler_epochs(
    n: int,
    world_size: int,
    epochs: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
    set_epoch: bool = True,
    seed: int = 0,
) -> list[list[list[int]]]:
    """``[epoch][rank] -> indices`` from PyTorch's DistributedSampler, one sampler
    per rank.

    The samplers are made once and iterated once per epoch, as a training loop does;
    ``set_epoch=False`` is the loop that forgets to call ``sampler.set_epoch(epoch)``.
    """
    dataset = range(n)  # the sampler only asks for len(dataset)
    samplers = [
        DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=r,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        for r in range(world_size)
    ]
    out = []
    for epoch in range(epochs):
        if set_epoch:
            for s in samplers:
                s.set_epoch(epoch)  # or every epoch replays the order of epoch 0
        out.append([list(s) for s in samplers])
    return out


def visit_counts(shards: list[list[int]], n: int) -> list[int]:
    """How many times each of the ``n`` samples appears in one epoch, all
    ranks together."""
    counts = Counter(i for shard in shards for i in shard)
    return [counts[i] for i in range(n)]


# --------------------------------------------------------------- two ways to feed ranks
# --- begin strategies ---
def own_shard(
    data: TokenData,
    step: int,
    global_batch: int,
    block_size: int,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank cuts its own rows: no communication, each rank needs the data."""
    return data.batch(
        "train", step, global_batch, block_size, seed, rank, world_size, device
    )


def scatter_from_rank0(
    data: TokenData | None,
    step: int,
    global_batch: int,
    block_size: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 builds the global batch and sends each rank its rows; only rank 0
    needs data."""
    rank, world_size = rank_world()
    if global_batch % world_size:
        raise ValueError(
            f"global batch {global_batch} does not split over {world_size} ranks"
        )
    # (2, B/N, T)
    mine = torch.empty(
        2, global_batch // world_size, block_size, dtype=torch.long, device=device
    )
    chunks = None
    if rank == 0:
        x, y = data.global_windows("train", step, global_batch, block_size, seed)
        # x and y in one message per rank; chunk r is rows [r*B/N, (r+1)*B/N), as in
        # batch(); on the rank's device, since NCCL sends only from GPU memory
        chunks = [
            c.to(device).contiguous()
            for c in torch.stack([x, y]).chunk(world_size, dim=1)
        ]
    dist.scatter(mine, chunks, src=0)  # rank 0 sends N-1 chunks and keeps its own
    return mine[0], mine[1]


# --- end strategies ---


def both_strategies(
    steps: int = 3, global_batch: int = 16, block_size: int = 64, seed: int = 1337
) -> list[tuple[torch.Tensor, ...]]:
    """On every rank: ``[(x_own, y_own, x_scattered, y_scattered) for each step]``, on
    the CPU."""
    rank, world_size = rank_world()
    data, device = token_data(), pick_device("auto", dist_env()[1])
    out = []
    for step in range(steps):
        x_own, y_own = own_shard(
            data, step, global_batch, block_size, seed, rank, world_size, device
        )
        x_sc, y_sc = scatter_from_rank0(
            data if rank == 0 else None, step, global_batch, block_size, seed, device
        )
        out.append(tuple(t.cpu() for t in (x_own, y_own, x_sc, y_sc)))
    return out


def time_strategies(
    global_batches: tuple[int, ...] = (16, 64, 256),
    block_size: int = 256,
    batches: int = 30,
    warmup: int = 3,
    seed: int = 1337,
) -> dict:
    """On every rank: seconds per batch of each strategy, ``{strategy: {B: [s, ...]}}``.

    The strategies take turns batch by batch, so a noisy neighbour on a shared machine
    slows both alike; a barrier before each batch lines the ranks up. A batch's time on
    a rank runs from asking for it to holding its rows, waits included (under scatter,
    rank 1 waits for rank 0 to build the batch: the cost of putting rank 0 on the path).
    """
    rank, world_size = rank_world()
    data, device = token_data(), pick_device("auto", dist_env()[1])
    fetch = {
        "own_shard": lambda s, B: own_shard(
            data, s, B, block_size, seed, rank, world_size, device
        ),
        "scatter": lambda s, B: scatter_from_rank0(
            data if rank == 0 else None, s, B, block_size, seed, device
        ),
    }
    result: dict = {"rank": rank, "world_size": world_size, "block_size": block_size}
    result.update({name: {B: [] for B in global_batches} for name in fetch})
    for B in global_batches:
        for step in range(warmup + batches):
            for name, get in fetch.items():
                dist.barrier()
                start = time.perf_counter()
                get(step, B)
                # on a GPU, until the rows are there, not just queued
                synchronize(device)
                if step >= warmup:
                    result[name][B].append(time.perf_counter() - start)
    dist.barrier()
    return result


# --------------------------------------------------------------- mp.spawn, watched
def try_spawn(fn, args: tuple = (), nprocs: int = 2, timeout: float = 60.0) -> str:
    """``mp.spawn(fn, args, nprocs)`` with a deadline; ``"ok"`` or the error, in
    one line.

    The children's tracebacks (they write to the inherited stderr) are captured, and the
    last line of them is returned with the parent's exception.
    """
    with tempfile.TemporaryFile() as err, contextlib.redirect_stderr(io.StringIO()):
        saved = os.dup(2)
        # the children inherit fd 2: their tracebacks land in err
        os.dup2(err.fileno(), 2)
        try:
            ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    return f"timed out after {timeout:.0f} s; the children were killed"
            return "ok"
        except Exception as exc:  # noqa: BLE001 -- reported, not handled
            err.seek(0)
            lines = [
                ln
                for ln in err.read().decode(errors="replace").splitlines()
                if ln.strip()
            ]
            child = f"; a child said: {lines[-1].strip()}" if lines else ""
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}{child}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# ------------------------------------------------------------- seeds, workers, sharding
def _gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)  # (N, *t.shape)


# --- begin seeds ---
def seeds_on_ranks(seed: int = 0, trials: int = 100) -> dict:
    """On every rank: are the weights equal on all ranks before and after DDP
    (``init``), the init seeded with ``seed + rank``; then, with one seed on all ranks
    (``same``) or ``seed + rank`` (``per_rank``), the share of dropout-mask elements
    equal on all ranks and, over ``trials`` mask draws (data and weights fixed), the
    summed variance of DDP's averaged gradient."""
    rank, world_size = rank_world()
    # the mistake: a per-rank seed before the model is built
    torch.manual_seed(seed + rank)
    # dropout before the ReLU: its input is never exactly 0, so ``out != 0`` is the
    # mask itself
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.Dropout(0.5),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )
    # (N, P)
    weights = [
        _gather(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
    ]
    model = DDP(model)  # broadcasts rank 0's parameters and buffers
    weights.append(
        _gather(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
    )
    out = {
        "rank": rank,
        "init": [bool((w == w[0]).all()) for w in weights],
        "mask_agree": {},
        "grad_var": {},
    }
    # (B, 16): this rank's data
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 + rank))
    masks: list[torch.Tensor] = []
    # (B, 64)
    model.module[1].register_forward_hook(lambda mod, inp, y: masks.append(y != 0))
    for mode in ("same", "per_rank"):
        grads = []
        for t in range(trials):
            torch.manual_seed(
                seed + t if mode == "same" else (seed + t) * world_size + rank
            )
            model.zero_grad()
            # DDP averages the gradients over the ranks
            model(x).pow(2).mean().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        every = _gather(masks[-1])  # (N, B, 64)
        out["mask_agree"][mode] = (every == every[0]).all(0).float().mean().item()
        # dropout's noise only
        out["grad_var"][mode] = torch.stack(grads).var(0).sum().item()
    return out


# --- end seeds ---


# --- begin probe ---
class SeedProbe(Dataset):
    """Each item says which worker made it and draws once from each random source."""

    def __init__(self, n: int):
        # made in the parent: every worker gets a copy
        self.n, self.rng = n, np.random.default_rng(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        info = get_worker_info()  # None in the main process
        draws = (
            torch.rand(()).item(),
            random.random(),
            float(np.random.random()),
            float(self.rng.random()),
        )
        return {
            "worker": info.id if info else -1,
            "seed": torch.initial_seed(),
            **dict(zip(SOURCES, draws)),
        }


SOURCES = ("torch", "random", "numpy", "dataset's rng")

# --- end probe ---


def worker_draws(seed: int = 0, items: int = 8, workers: int = 2) -> dict:
    """On every rank: the probe's items through a DataLoader with workers, the rank's
    torch RNG seeded alike on all ranks (``same``) or with ``seed + rank``
    (``per_rank``)."""
    out = {}
    for mode in ("same", "per_rank"):
        # the loader draws base_seed from it
        torch.manual_seed(seed if mode == "same" else seed + rank_world()[0])
        out[mode] = list(
            DataLoader(SeedProbe(items), batch_size=None, num_workers=workers)
        )
    return out


def samples_read(
    datasets: dict[str, IterableDataset], workers: int = 2
) -> dict[str, list[int]]:
    """On every rank: the items its DataLoader, with ``workers`` workers, yields from
    each dataset."""
    return {
        name: [int(i) for i in DataLoader(d, batch_size=None, num_workers=workers)]
        for name, d in datasets.items()
    }
