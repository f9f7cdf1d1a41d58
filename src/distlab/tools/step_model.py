"""A model of one DDP step: will the gradient all-reduce hide behind the backward pass?

    link = link_from_nccl_tests(rows, n=16)  # your all_reduce_perf (bytes, us) rows
    # sequences per GPU
    smallest_batch(preset("gpt2", vocab_size=50257), 16, link, 0.4 * 989.5e12)

The step: forward (1/3 of the compute), backward (2/3), and DDP's buckets, each
all-reduced as soon as backward has completed its last gradient, one after the other on
one communication stream. A bucket costs ``base + 2(N-1) alpha + 2(N-1)/N bytes /
busbw`` (the ring of book/collectives.md, plus NCCL's per-call latency). Whatever
communication is still running when backward ends is exposed. Efficiency is compute
time over step time. Everything here is plain arithmetic on its inputs: the inputs
decide whether its answers are a measurement's or a datasheet's, and the page says
which.
"""

from __future__ import annotations

import functools
import itertools

import torch

from distlab.costs import collectives as nccl
from distlab.costs.buckets import (
    DEFAULT_CAP_BYTES,
    FIRST_BUCKET_BYTES,
    MiB,
    bucket_sizes,
    steady_ready,
    timeline,
)
from distlab.costs.collectives import Link, ring_all_reduce_s
from distlab.errors import UserError
from distlab.flops import flops_per_token
from distlab.model import GPT, GPTConfig

# The GPU links are inputs, not measurements of this page. NVLink: the ring's busbw on 8
# H100s that NCCL's maintainer quotes (nccl-tests#212); networks: a NIC's line rate (100
# and 400 Gb/s: 12.5 and 50 GB/s each way), one GPU per node. Latencies: NCCL's tuning
# model for a Ring/Simple all-reduce (costs.collectives), the network's with the plateau
# factor NCCL applies to multi-node rings.
_NET_ALPHA = nccl.RING_PLATEAU * nccl.NET_STEP
_NET_BASE = nccl.RING_PLATEAU * nccl.BASE_SIMPLE
GPU_LINKS = {
    "NVLink (one node)": Link(
        "NVLink (one node)",
        nccl.RING_NVLINK,
        nccl.NVLINK_BUSBW,
        "nccl-tests#212 (busbw); NCCL tuning.cc",
        nccl.BASE_SIMPLE,
    ),
    "400 Gb/s network": Link(
        "400 Gb/s network", _NET_ALPHA, 50e9, "line rate; NCCL tuning.cc", _NET_BASE
    ),
    "100 Gb/s network": Link(
        "100 Gb/s network", _NET_ALPHA, 12.5e9, "line rate; NCCL tuning.cc", _NET_BASE
    ),
}
# an assumption, not a measurement: the fraction of the bf16 datasheet peak the GPU
# model computes at
ASSUMED_MFU = 0.4


@functools.cache
def _meta_model(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):  # shapes only: GPT-2 small is not allocated
        return GPT(cfg)


def gradient_bytes(cfg: GPTConfig, bytes_per_element: int = 4) -> list[int]:
    """Bytes of each parameter's gradient, in ``model.parameters()`` order (fp32
    gradients: DDP all-reduces gradients in the parameters' dtype, fp32 under bf16
    autocast too)."""
    return [p.numel() * bytes_per_element for p in _meta_model(cfg).parameters()]


def backward_done(cfg: GPTConfig) -> list[float]:
    """For each gradient, in the order backward completes them (reversed
    ``parameters()``), the fraction of backward's FLOPs done by then. A weight matrix
    costs 4 FLOPs per element per token (input and weight gradients), attention's
    scores and weighted sum 8 C T per layer, before the qkv weight's gradient. The
    tied embedding is the exception: its matrix is the output head, whose backward
    runs first, but its gradient is complete only after the embedding lookup's
    backward, the very last."""
    model = _meta_model(cfg)
    C, T = cfg.n_embd, cfg.block_size
    done = [4 * model.lm_head.weight.numel()]  # the head's backward comes first
    for name, p in reversed(list(model.named_parameters())):
        embedding = name.split(".")[0] in ("wte", "wpe")  # lookups: no FLOPs
        work = 4 * p.numel() if p.dim() == 2 and not embedding else 0
        work += 8 * C * T if name.endswith("attn.qkv.weight") else 0
        done.append(done[-1] + work)
    total = done[-1]
    return [d / total for d in done[1:]]


def bucket_ready(grad_bytes: list[int], done: list[float], buckets: list[int]):
    """The fraction of backward at which each bucket's last gradient is complete
    (``done`` from ``backward_done``, in backward order)."""
    ready, filled, k = [], 0, 0
    for size, fraction in zip(reversed(grad_bytes), done):
        filled += size
        if k < len(buckets) and filled == sum(buckets[: k + 1]):
            ready.append(fraction)
            k += 1
    return ready


def ddp_default_buckets(cfg: GPTConfig) -> list[int]:
    """The buckets DDP uses from the second step on, with its defaults (1 MiB first,
    then 25 MiB)."""
    return bucket_sizes(gradient_bytes(cfg), DEFAULT_CAP_BYTES, FIRST_BUCKET_BYTES)


def ddp_schedule(cfg: GPTConfig, cap_bytes: int | None = None):
    """(buckets, ready): DDP's buckets for ``cfg`` and the fraction of backward at
    which each is ready. ``cap_bytes`` None is DDP's default (``bucket_cap_mb`` not
    passed: 1 MiB first, then 25 MiB); a number caps every bucket."""
    grads = gradient_bytes(cfg)
    if cap_bytes is None:
        buckets = bucket_sizes(grads, DEFAULT_CAP_BYTES, FIRST_BUCKET_BYTES)
    else:
        buckets = bucket_sizes(grads, cap_bytes)
    return buckets, bucket_ready(grads, backward_done(cfg), buckets)


# --- begin step ---
def ddp_step(
    compute_s: float,
    buckets: list[int],
    n: int,
    link: Link,
    overlap: bool = True,
    ready: list[float] | None = None,
) -> dict:
    """One DDP step's times (seconds) and its efficiency, compute / step. Backward
    is 2/3 of ``compute_s``; bucket k is ready at ``ready[k]`` of it (default: bytes
    at a steady rate). ``overlap=False``: nothing is free to communicate while the
    machine computes (this page's CPUs), so every bucket waits for backward's end."""
    backward = 2 * compute_s / 3
    if ready is None:  # bytes at a steady rate
        ready = steady_ready(buckets)
    run = timeline(
        backward, buckets, ready, lambda b: ring_all_reduce_s(b, n, link), overlap
    )
    step = compute_s + run["exposed"]
    return {
        "compute": compute_s,
        "comm": run["comm"],
        "exposed": run["exposed"],
        "step": step,
        "efficiency": compute_s / step,
        "spans": run["spans"],  # (ready, start, end), from backward's start
    }


# --- end step ---


def compute_seconds(
    cfg: GPTConfig, batch: int, flops_per_s: float, seq_len: int | None = None
) -> float:
    """Forward and backward of ``batch`` sequences of ``seq_len`` tokens (the model's
    block size)."""
    seq_len = seq_len or cfg.block_size
    return batch * seq_len * flops_per_token(cfg, seq_len) / flops_per_s


def efficiency(
    cfg: GPTConfig, batch: int, n: int, link: Link, flops_per_s: float, schedule=None
) -> float:
    buckets, ready = schedule or ddp_schedule(cfg)
    compute = compute_seconds(cfg, batch, flops_per_s)
    return ddp_step(compute, buckets, n, link, ready=ready)["efficiency"]


def smallest_batch(
    cfg: GPTConfig,
    n: int,
    link: Link,
    flops_per_s: float,
    target: float = 0.9,
    most: int = 2**20,
) -> int | None:
    """The fewest sequences per GPU (of ``cfg.block_size`` tokens) whose step reaches
    ``target`` efficiency; None if not even ``most`` do (the latency alone is
    too large)."""
    if not 0 < target < 1:
        raise UserError(f"target efficiency must be between 0 and 1, got {target}")
    schedule = ddp_schedule(cfg)
    if efficiency(cfg, most, n, link, flops_per_s, schedule) < target:
        return None
    # efficiency grows with the batch: bisect for the first batch that reaches target
    low, high = 0, most
    while high - low > 1:
        mid = (low + high) // 2
        reaches = efficiency(cfg, mid, n, link, flops_per_s, schedule) >= target
        low, high = (low, mid) if reaches else (mid, high)
    return high


def link_from_nccl_tests(
    rows: list[tuple[float, float]], n: int, low: float = MiB, high: float = 64 * MiB
) -> Link:
    """A link fitted to ``all_reduce_perf`` rows, (size in bytes, time in us), on the
    sizes DDP's buckets have (``low`` .. ``high``): those run the same protocol as the
    buckets (Simple), where an 8-byte row runs LL and a GB row reaches a bandwidth a 25
    MiB bucket never sees. Least squares: time = base + size / algbw."""
    points = [(s, t * 1e-6) for s, t in rows if low <= s <= high]
    if len(points) < 2:
        raise UserError(
            f"need at least 2 all_reduce_perf rows between {low / MiB:g} and "
            f"{high / MiB:g} MiB, got {len(points)}: run it with -b 1M -e 64M -f 2"
        )
    mean_s = sum(s for s, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in points) / sum(
        (s - mean_s) ** 2 for s, _ in points
    )
    if slope <= 0:
        raise UserError("the rows' time does not grow with the size: check the run")
    base = max(0.0, mean_t - slope * mean_s)
    # all_reduce_perf's busbw is algbw x 2(N-1)/N
    return Link("your nccl-tests run", 0.0, 2 * (n - 1) / n / slope, "fitted", base)


def smallest_batch_from_nccl_tests(
    cfg: GPTConfig,
    n: int,
    rows: list[tuple[float, float]],
    flops_per_s: float,
    target: float = 0.9,
) -> int | None:
    """``smallest_batch`` for your cluster, from ``all_reduce_perf``'s (size in
    bytes, time in us) rows between 1 and 64 MiB, run on the ``n`` GPUs and with the
    NCCL settings your job uses."""
    return smallest_batch(cfg, n, link_from_nccl_tests(rows, n), flops_per_s, target)


def best_bucket_cap(
    cfg: GPTConfig,
    batch: int,
    n: int,
    link: Link,
    flops_per_s: float,
    caps_mib=None,
    overlap: bool = True,
) -> tuple[float, dict[float, float]]:
    """The ``bucket_cap_mb`` (passed, so every bucket has that cap) with the shortest
    step, and the step time at every cap tried. Small buckets expose less at the end and
    pay the latency more often."""
    # 1/8 MiB ... 256 MiB, and the default
    caps_mib = caps_mib or sorted([2.0**k for k in range(-3, 9)] + [25.0])
    compute, grads = compute_seconds(cfg, batch, flops_per_s), gradient_bytes(cfg)
    done, steps = backward_done(cfg), {}
    for cap in caps_mib:
        buckets = bucket_sizes(grads, int(cap * MiB))
        ready = bucket_ready(grads, done, buckets)
        steps[cap] = ddp_step(compute, buckets, n, link, overlap, ready)["step"]
    return min(steps, key=steps.get), steps


def efficiency_table(
    presets: dict[str, GPTConfig], n: int, flops_per_s: float
) -> list[tuple[str, str, int | None]]:
    """(model, link, smallest batch for 90%) for every preset on every GPU link."""
    return [
        (name, link.name, smallest_batch(cfg, n, link, flops_per_s))
        for (name, cfg), link in itertools.product(presets.items(), GPU_LINKS.values())
    ]
