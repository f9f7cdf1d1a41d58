"""Feeding the ranks: which samples each rank sees, how they get there, and
their randomness.

Used by the chapter "Feeding the ranks" and checked by its tests:

* ``DistributedSampler`` as it really behaves: ``sampler_epochs`` runs PyTorch's own
  sampler for every rank (``num_replicas`` and ``rank`` passed, no process group); the
  rule written out by hand is in ``distlab.scratch.sampler``.
* Two strategies for the book's token data, measured on real ranks: every rank cuts its
  own rows of the global batch (``own_shard``, as the labs do), or rank 0 scatters them.
* Seeds per rank (``seeds_on_ranks``), DataLoader workers' seeds (``SeedProbe``) and an
  ``IterableDataset`` read by rank x worker (``samples_read``), run inside the ranks by
  one launch (``feeding_experiments``).
"""

from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from distlab.data import TokenData, token_data
from distlab.runtime import dist_env, pick_device, rank_world, synchronize
from distlab.tools.sharding import ShardedIterable


# --------------------------------------------------------------- DistributedSampler
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
    datasets: dict[str, IterableDataset], workers: int = 2, context: str | None = None
) -> dict[str, list[int]]:
    """On every rank: the items its DataLoader, with ``workers`` workers started by
    ``context`` (None: the platform's default, fork on Linux), yields from each
    dataset."""
    return {
        name: [
            int(i)
            for i in DataLoader(
                d, batch_size=None, num_workers=workers, multiprocessing_context=context
            )
        ]
        for name, d in datasets.items()
    }


class EveryItem(IterableDataset):
    """The naive stream: every copy yields all items (``by_rank``: its rank's every
    N-th), whichever worker it runs in."""

    def __init__(self, items: list, by_rank: bool = False):
        self.items, self.by_rank = items, by_rank
        self.rank, self.world_size = rank_world()

    def __iter__(self):
        if self.by_rank:
            yield from self.items[self.rank :: self.world_size]
        else:
            yield from self.items


# the global batches timed, and the batches timed at each (after 2 of warm-up)
GLOBAL_BATCHES, BATCHES = (8, 16, 64, 256, 1024), 12


def feeding_experiments(n_items: int = 64) -> dict:
    """Everything the chapter runs on its 2 ranks, in one launch: seeds, DataLoader
    workers' draws, three ways to read a stream (read with forked workers, and the
    sharded one again with forkserver workers), and the two loading strategies, checked
    and timed."""
    items = list(range(n_items))
    splits = {
        "naive": EveryItem(items),
        "by rank": EveryItem(items, by_rank=True),
        "by rank x worker": ShardedIterable(items),
    }
    return {
        "seeds": seeds_on_ranks(trials=100),
        "draws": worker_draws(),
        "reads": samples_read(splits, workers=2),
        "forkserver": samples_read(
            {"by rank x worker": ShardedIterable(items)}, 2, "forkserver"
        ),
        "rows": both_strategies(steps=3, global_batch=16, block_size=256),
        "times": time_strategies(GLOBAL_BATCHES, 256, batches=BATCHES, warmup=2),
    }


def timing_figure(median_ms: dict):
    """ms per batch (median) of each strategy on each rank, against the global batch;
    ``median_ms[(strategy, rank, B)]``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, color in (("own_shard", "#3b6ea5"), ("scatter", "#e39b4c")):
        for r, style in ((0, "-o"), (1, "--s")):
            ax.plot(
                GLOBAL_BATCHES,
                [median_ms[(s, r, B)] for B in GLOBAL_BATCHES],
                style,
                color=color,
                label=f"{s.replace('_', ' ')}, rank {r}",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(GLOBAL_BATCHES, [str(B) for B in GLOBAL_BATCHES])
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("global batch (windows of 256 tokens)", fontsize=12)
    ax.set_ylabel(f"ms per batch (median of {BATCHES})", fontsize=12)
    ax.legend(frameon=False, fontsize=11)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
