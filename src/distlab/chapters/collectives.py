"""The Collective communication chapter's experiments, and its timing figure: the five
collectives live (``run_ranks(all_demos, nprocs=3)``), the ring all-reduce of
``distlab.scratch.collectives`` against ``dist.all_reduce`` at every step
(``ring_check(3)``), and what all-reducing costs
(``summarise_timings(run_ranks(time_collectives, nprocs=2, args=(SIZES,)))``). Functions
that call ``dist`` run on every rank of a group (``distlab.infra.launch.run_ranks``)."""

import itertools
import os
import statistics
import time
import timeit

import torch
import torch.distributed as dist

from distlab.infra.launch import run_ranks
from distlab.runtime import dist_env, pick_device, rank_world, synchronize
from distlab.scratch.collectives import (
    model_time,
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


# --- begin broadcast ---
def data() -> torch.Tensor:
    rank, _ = rank_world()
    # the digits of a sum name the ranks in it
    return torch.tensor([1, 2, 3], device=_device()) * 10**rank


def broadcast() -> dict:
    t = data()
    before = t.tolist()
    dist.broadcast(t, src=0)  # in place: afterwards every rank holds rank 0's tensor
    return {"before": before, "after": t.tolist()}


# --- end broadcast ---


def all_reduce() -> dict:
    t = data()
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {"before": before, "after": t.tolist()}


def reduce_scatter() -> dict:
    t = data()
    before = t.tolist()
    # 3 elements / 3 ranks: one each
    mine = torch.empty(1, dtype=t.dtype, device=t.device)
    dist.reduce_scatter_single(mine, t)
    return {"before": before, "after": mine.tolist()}


def all_gather() -> dict:
    piece = data()[:1]  # each rank contributes one element
    before = piece.tolist()
    everything = torch.empty(rank_world()[1], dtype=piece.dtype, device=piece.device)
    dist.all_gather_single(everything, piece)
    return {"before": before, "after": everything.tolist()}


def barrier() -> dict:
    dist.barrier()  # line the ranks up so their clocks start together
    start = time.perf_counter()
    time.sleep(0.2 * rank_world()[0])  # rank r is 0.2 r seconds late
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


DEMOS = (broadcast, all_reduce, reduce_scatter, all_gather, barrier)


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


def all_demos() -> dict:
    """Every demo, the reduction operators and the parity exchange, in one launch
    (starting processes takes seconds)."""
    return {
        "demos": [demo() for demo in DEMOS],
        "reduce_ops": reduce_ops(),
        "exchange": exchange_ranks(),
    }


def before_after_table(title: str, per_rank: list[dict]) -> str:
    """What each rank held before and after a collective, as a small text table."""
    width = max(len(str(v)) for row in per_rank for v in row.values()) + 3
    lines = [title, f"{'':8}{'before':<{width}}{'after':<{width}}"]
    for rank, row in enumerate(per_rank):
        lines.append(
            f"rank {rank:<3}{str(row['before']):<{width}}{str(row['after']):<{width}}"
        )
    return "\n".join(lines) + "\n"


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


def ring_check(n: int, device: str = "cpu") -> dict:
    """``ring_vs_library`` on ``n`` ranks (gloo CPU ranks, or NCCL GPU ranks with
    ``device="cuda"``), compared with the simulation ``ring_schedule``."""
    results = run_ranks(ring_vs_library, nprocs=n, quiet=True, device=device)
    simulated = [
        [[sum(2**s for s in held) for held in row] for row in e["holds"]]
        for e in ring_schedule(n)
    ]
    real = [[results[rank][2][k] for rank in range(n)] for k in range(2 * (n - 1) + 1)]
    worst, ints_equal = max(r[0] for r in results), all(r[1] for r in results)
    return {
        "worst": worst,
        "ints_equal": ints_equal,
        "matches_simulation": real == simulated,
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


# --- the timings' picture (the ring's own are drawn in distlab.scratch.collectives) ---
def timing_figure(summary: dict, copy_bw: float):
    """Time and bus bandwidth against message size, medians and middle half of
    the repeats."""
    import matplotlib.pyplot as plt

    n, sizes, per_repeat, median, busbw = (
        summary[k] for k in ("ranks", "sizes", "per_repeat", "median", "busbw")
    )
    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
    kb = [s / 1024 for s in sizes]
    for name, color in zip(ALL_REDUCES, ("#3b6ea5", "#e39b4c")):
        q1, _, q3 = zip(
            *(statistics.quantiles(per_repeat[name, s], n=4) for s in sizes)
        )
        ax_t.fill_between(
            kb, [q * 1e3 for q in q1], [q * 1e3 for q in q3], color=color, alpha=0.2
        )
        ax_t.plot(
            kb,
            [median[name, s] * 1e3 for s in sizes],
            "o-",
            color=color,
            label=f"{name} (median)",
        )
        ax_bw.plot(
            kb, [busbw[name, s] / 1e9 for s in sizes], "o-", color=color, label=name
        )
    fit = summary["fit"]["dist.all_reduce"]
    model = [model_time(fit["alpha"], fit["bandwidth"], n, s) * 1e3 for s in sizes]
    ax_t.plot(
        kb,
        model,
        "--",
        color="#555",
        label="$\\alpha$-$\\beta$ model, fitted to dist.all_reduce",
    )
    ax_t.set(
        ylabel="time (ms)",
        title=f"all-reduce on {n} gloo ranks (band: middle half of repeats)",
    )
    ax_bw.set(ylabel="bus bandwidth (GB/s)", title="bus bandwidth = 2(N-1)/N · S / t")
    ax_bw.axhline(
        copy_bw / 1e9,
        color="#999",
        ls=":",
        label=f"a {sizes[-1] >> 20} MB copy within one process",
    )
    for ax in (ax_t, ax_bw):
        ax.set(xscale="log", yscale="log", xlabel="message size (KB)")
        ax.set_xticks(kb, [f"{k:,.0f}" for k in kb], fontsize=8)
        ax.minorticks_off()
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
