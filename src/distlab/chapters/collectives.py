"""The Collective communication chapter's experiments and its picture of them.

One launch of 4 gloo ranks, ``run_ranks(all_demos, nprocs=4)``, runs everything the page
shows live: what the launcher told each rank, the collectives on readable data
(``collectives_figure`` draws them), the reduction operators, the ring all-reduce of
``distlab.scratch.collectives`` against ``dist.all_reduce`` at every step
(``ring_matches``), the parity-ordered exchange, and sums over a 2 x 2 DeviceMesh.

What all-reducing costs is a recorded benchmark (``python -m
distlab.bench.collectives``), timed by ``time_collectives`` and summarised by
``summarise_timings``, which ``book/ddp_scaling.md`` and
``distlab.bench.planner_inputs`` use too. Functions that call ``dist`` run on every
rank of a group (``distlab.infra.launch.run_ranks``)."""

import itertools
import os
import statistics
import time
import timeit

import torch
import torch.distributed as dist

from distlab.runtime import dist_env, pick_device, rank_world, synchronize
from distlab.scratch.collectives import (
    parity_ring_exchange,
    ring_all_reduce,
    ring_bytes_sent_per_rank,
    ring_schedule,
)

SIZES = [2**k for k in range(10, 25, 2)]  # 1 KB, 4 KB, ... 16 MB of float32
ALL_REDUCES = ("dist.all_reduce", "ring_all_reduce")


def environment() -> dict:
    """What the launcher told this rank, and what the process group says about it."""
    env = {
        name: os.environ[name]
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    group = {
        "dist.get_rank()": dist.get_rank(),
        "dist.get_world_size()": dist.get_world_size(),
    }
    return {**env, **group, "dist.get_backend()": dist.get_backend()}


def _device() -> torch.device:
    """This rank's device as its launch chose it: a GPU on NCCL ranks (NCCL moves only
    GPU tensors), else the CPU."""
    return pick_device("auto", dist_env()[1])


# --- begin all_reduce ---
def data() -> torch.Tensor:
    rank, n = rank_world()
    # rank r holds [1, 2, ..., n] * 10**r: a sum's digits name its ranks
    return torch.arange(1, n + 1, device=_device()) * 10**rank


def all_reduce() -> dict:
    t = data()
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # in place: the sum on every rank
    return {"before": before, "after": t.tolist()}


# --- end all_reduce ---


# --- begin others ---
def broadcast() -> dict:
    t = data()
    before = t.tolist()
    dist.broadcast(t, src=0)  # in place: afterwards every rank holds rank 0's tensor
    return {"before": before, "after": t.tolist()}


def reduce_scatter() -> dict:
    t = data()
    before = t.tolist()
    # n elements / n ranks: one each, rank r gets element r of the sum
    mine = torch.empty(1, dtype=t.dtype, device=t.device)
    dist.reduce_scatter_single(mine, t)
    return {"before": before, "after": mine.tolist()}


def all_gather() -> dict:
    piece = data()[:1]  # each rank contributes one element
    before = piece.tolist()
    everything = torch.empty(rank_world()[1], dtype=piece.dtype, device=piece.device)
    dist.all_gather_single(everything, piece)
    return {"before": before, "after": everything.tolist()}


def all_to_all() -> dict:
    t = data()
    before = t.tolist()
    out = torch.empty_like(t)
    # element j goes to rank j: rank r ends with element r of every rank's tensor
    dist.all_to_all_single(out, t)
    return {"before": before, "after": out.tolist()}


def barrier() -> dict:
    dist.barrier()  # line the ranks up so their clocks start together
    start = time.perf_counter()
    time.sleep(0.1 * rank_world()[0])  # rank r is 0.1 r seconds late
    arrived, arrived_at = time.perf_counter() - start, time.monotonic()
    dist.barrier()
    left, left_at = time.perf_counter() - start, time.monotonic()
    # the monotonic clock is one clock for every process on this machine: every rank's
    # left_at comes after the last rank's arrived_at, however loaded the machine
    return {
        "before": f"arrives at {arrived:.2f} s",
        "after": f"leaves at {left:.2f} s",
        "clock": (arrived_at, left_at),
    }


# --- end others ---


DEMOS = (broadcast, all_reduce, reduce_scatter, all_gather, all_to_all, barrier)


# --- begin reduce_ops ---
def reduce_ops() -> dict[tuple[str, str], list | str]:
    """What all_reduce leaves on this rank per operator and dtype, or the
    backend's error."""
    ops = {
        "SUM": dist.ReduceOp.SUM,
        "AVG": dist.ReduceOp.AVG,
        "PREMUL_SUM(0.5)": dist.ReduceOp.PREMUL_SUM(0.5),
    }
    results = {}
    for (name, op), dtype in itertools.product(
        ops.items(), (torch.float32, torch.int64)
    ):
        t = data().to(dtype)
        try:
            dist.all_reduce(t, op=op)
            results[name, str(dtype)] = t.tolist()
        # refused by the backend, for this operator or this dtype
        except RuntimeError as err:
            results[name, str(dtype)] = str(err).splitlines()[0]
    return results


# --- end reduce_ops ---


# --- begin mesh ---
def mesh_sums() -> dict:
    """Sums over each dimension of a 2 x (N/2) DeviceMesh, with functional
    collectives."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    rank, n = rank_world()
    # ranks [[0, 1], [2, 3]]: "dp" groups the columns, "tp" the rows
    mesh = init_device_mesh(_device().type, (2, n // 2), mesh_dim_names=("dp", "tp"))
    t = torch.tensor([10**rank], device=_device())
    sums = {
        # a new tensor each time: functional collectives leave their input alone
        dim: funcol.all_reduce(t, "sum", mesh.get_group(dim)).tolist()
        for dim in ("dp", "tp")
    }
    return {"coordinate": mesh.get_coordinate(), "input": t.tolist(), **sums}


# --- end mesh ---


def all_demos() -> dict:
    """Everything the page runs live, in one launch (starting processes takes
    seconds)."""
    return {
        "env": environment(),
        "demos": [demo() for demo in DEMOS],
        "reduce_ops": reduce_ops(),
        "ring": ring_vs_library(),
        "exchange": exchange_ranks(),
        "mesh": mesh_sums(),
    }


def ring_vs_library() -> tuple[float, bool, list[list[int]]]:
    """On every rank: the worst float difference between the ring and
    ``dist.all_reduce``, whether integer sums are identical, and after each step k the
    ring's partial sums of 2**rank (one element per chunk: each sum is a bit mask of the
    ranks it contains)."""
    rank, n = rank_world()
    device = _device()
    torch.manual_seed(rank)
    worst, ints_equal = 0.0, True
    # fewer than n, divisible, not divisible
    for numel in (n - 1, 10 * n, 10 * n + 1, 100_003):
        x, i = (
            torch.randn(numel).to(device),
            torch.randint(-100, 100, (numel,)).to(device),
        )
        x_ref, i_ref = x.clone(), i.clone()
        dist.all_reduce(x_ref)
        dist.all_reduce(i_ref)
        ring_all_reduce(x)
        ring_all_reduce(i)
        worst = max(worst, (x - x_ref).abs().max().item())
        ints_equal &= torch.equal(i, i_ref)
    masks = [
        ring_all_reduce(torch.full((n,), 2**rank, device=device), max_steps=k).tolist()
        for k in range(2 * (n - 1) + 1)
    ]
    return worst, ints_equal, masks


def ring_matches(per_rank: list) -> dict:
    """``ring_vs_library``'s results of every rank, and whether the ring's state after
    every step equals the simulation ``ring_schedule``."""
    n = len(per_rank)
    simulated = [
        [[sum(2**s for s in held) for held in row] for row in e["holds"]]
        for e in ring_schedule(n)
    ]
    real = [[per_rank[r][2][k] for r in range(n)] for k in range(2 * (n - 1) + 1)]
    return {
        "worst": max(r[0] for r in per_rank),
        "ints_equal": all(r[1] for r in per_rank),
        "matches_simulation": real == simulated,
        "steps": len(real) - 1,
    }


def exchange_ranks() -> int:
    """Every rank sends its rank to the right with the parity-ordered
    blocking exchange."""
    return parity_ring_exchange(
        torch.tensor([rank_world()[0]], device=_device())
    ).item()


# --- begin timing ---
def timed(op, repeats: int, device: torch.device) -> list[float]:
    """Seconds per repeat of ``op`` on this rank (on ``device``); each repeat starts at
    a barrier."""
    op()  # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier()  # start together
        start = time.perf_counter()
        op()
        # on a GPU the call returns once the collective is queued, not done
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return samples


def time_collectives(sizes: list[int]) -> dict[tuple[str, int], list[float]]:
    """On every rank: both all-reduces at every size, and gloo's two halves at
    the largest."""
    times, device = {}, _device()
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=device)  # float32
        repeats = 21 if nbytes < 2**22 else 7  # cheap below 4 MB: more repeats
        times["dist.all_reduce", nbytes] = timed(
            lambda x=x: dist.all_reduce(x), repeats, device
        )
        times["ring_all_reduce", nbytes] = timed(
            lambda x=x: ring_all_reduce(x), repeats, device
        )
    x, largest = torch.ones(sizes[-1] // 4, device=device), sizes[-1]
    shard = torch.empty(x.numel() // rank_world()[1], device=device)
    times["dist.reduce_scatter_single", largest] = timed(
        lambda: dist.reduce_scatter_single(shard, x), 7, device
    )
    times["dist.all_gather_single", largest] = timed(
        lambda: dist.all_gather_single(x, shard), 7, device
    )
    return times


# --- end timing ---


def summarise_timings(per_rank: list[dict], small_bytes: int = 16 * 1024) -> dict:
    """Repeats (each as long as its slower rank), medians, bus bandwidth, and
    ``model_time``'s alpha and B fitted per all-reduce: messages up to ``small_bytes``
    are all latency (their pooled median is 2(N-1) alpha); the largest message, almost
    all bandwidth, gives B."""
    n = len(per_rank)
    per_repeat = {
        key: [max(ts) for ts in zip(*(r[key] for r in per_rank))] for key in per_rank[0]
    }
    median = {key: statistics.median(ts) for key, ts in per_repeat.items()}
    busbw = {
        key: ring_bytes_sent_per_rank(key[1] // 4, n, 4) / t
        for key, t in median.items()
    }
    sizes = sorted({s for name, s in per_repeat if name == ALL_REDUCES[0]})
    fit = {}
    for name in ALL_REDUCES:
        latency = statistics.median(
            [t for s in sizes if s <= small_bytes for t in per_repeat[name, s]]
        )
        # bytes each rank sends for the largest
        wire = ring_bytes_sent_per_rank(sizes[-1], n, 1)
        fit[name] = {
            "alpha": latency / (2 * (n - 1)),
            "bandwidth": wire / (median[name, sizes[-1]] - latency),
        }
    return {
        "ranks": n,
        "sizes": sizes,
        "per_repeat": per_repeat,
        "median": median,
        "busbw": busbw,
        "fit": fit,
    }


def copy_bandwidth(nbytes: int, repeats: int = 21) -> float:
    """Bytes per second of one plain in-process copy of ``nbytes`` (median of
    ``repeats``)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return nbytes / statistics.median(
        timeit.repeat(lambda: dst.copy_(src), number=1, repeat=repeats)
    )


# --------------------------------------------- the live collectives, drawn from a run
def _contributors(value: int) -> int:
    """How many ranks a value of ``data()``'s sums holds: its nonzero digits."""
    return sum(d != "0" for d in str(abs(int(value))))


TITLES = {
    "broadcast": "broadcast(src=0)",
    "all_reduce": "all_reduce (SUM)",
    "reduce_scatter": "reduce_scatter: rank r\ngets element r of the sum",
    "all_gather": "all_gather of each\nrank's first element",
    "all_to_all": "all_to_all: rank r gets\nelement r of every rank",
}


def collectives_figure(per_rank: list[dict]):
    """What every rank held before the collectives and after each one that moves data:
    a grid per collective, a row per rank; the darker a cell, the more ranks its
    value sums."""
    import matplotlib.pyplot as plt

    n, cmap = len(per_rank), plt.get_cmap("Blues")
    before = [r["demos"][0]["before"] for r in per_rank]
    panels = [("before: rank $r$ holds\n$[1, 2, ..., N] \\times 10^r$", before)]
    panels += [
        (TITLES[demo.__name__], [r["demos"][i]["after"] for r in per_rank])
        for i, demo in enumerate(DEMOS)
        if demo is not barrier
    ]
    fig, axes = plt.subplots(3, 2, figsize=(5.6, 8.6))
    for ax, (title, rows) in zip(axes.flat, panels):
        ax.set(xlim=(-0.5, n - 0.5), ylim=(n - 0.5, -0.5), xticks=[])
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=11)
        ax.tick_params(length=0)
        ax.spines[:].set_visible(False)
        for r, row in enumerate(rows):
            for c, value in enumerate(row):
                share = _contributors(value) / n
                fill = cmap(0.12 + 0.7 * share)
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fc=fill, ec="w"))
                ink = "white" if share > 0.6 else "black"
                ax.text(c, r, value, ha="center", va="center", fontsize=12, color=ink)
        ax.set_title(title, fontsize=12)
    fig.tight_layout()
    return fig
