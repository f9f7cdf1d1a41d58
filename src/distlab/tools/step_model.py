"""A model of one DDP step: will the gradient all-reduce hide behind the backward pass?

    link = Link("my cluster", alpha=10e-6, busbw=40e9, source="nccl-tests on 2 nodes")
    # sequences per GPU
    smallest_batch(preset("gpt2"), n=16, link=link, flops_per_s=0.4 * 989.5e12)

The step: forward (1/3 of the compute), backward (2/3), and DDP's buckets, each
all-reduced with the ring as soon as backward has produced its last gradient, one after
the other on one communication stream. A bucket costs ``2(N-1) alpha + 2(N-1)/N bytes /
busbw`` (the ring of book/collectives.md). Whatever communication is still running when
backward ends is exposed: with fast links that is the last bucket; with slow ones, more.
Efficiency is compute time over step time. Everything here is plain arithmetic on its
inputs: the inputs decide whether its answers are a measurement's or a datasheet's, and
the page says which.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from distlab.errors import UserError
from distlab.flops import flops_per_token
from distlab.model import GPT, GPTConfig

MiB = 2**20
# dist._DEFAULT_FIRST_BUCKET_BYTES: the first bucket when bucket_cap_mb is not passed
FIRST_BUCKET_BYTES = 1 * MiB
DEFAULT_CAP_BYTES = 25 * MiB  # DDP's bucket_cap_mb default


@dataclass(frozen=True)
class Link:
    """What one rank's all-reduce runs over: a per-step latency and a bus
    bandwidth (bytes/s)."""

    name: str
    alpha: float  # seconds per ring step
    busbw: float  # bytes per second each rank's link moves, the nccl-tests "busbw"
    source: str  # where the two numbers come from


# The GPU links are inputs, not measurements. Bandwidths: the NVIDIA H100 Tensor Core
# GPU datasheet (SXM: NVLink 900 GB/s, both directions together: 450 GB/s each way) and
# a NIC's line rate (100 and 400 Gb/s: 12.5 and 50 GB/s each way; 400 Gb/s is the NVIDIA
# ConnectX-7 datasheet's). Latencies: NCCL's own tuning model, per ring step with its
# Simple protocol (the one for large messages): 3.4 us over NVLink and 9.6 us over the
# network (hwLat in src/graph/tuning.cc).
NCCL_TUNING = "https://github.com/NVIDIA/nccl/blob/01afd20a77b5804e0ecf1042509dd9d20ebf9e93/src/graph/tuning.cc"
GPU_LINKS = {
    "NVLink (one node)": Link(
        "NVLink (one node)", 3.4e-6, 450e9, "H100 SXM datasheet; NCCL tuning.cc"
    ),
    "400 Gb/s network": Link(
        "400 Gb/s network", 9.6e-6, 50e9, "400 Gb/s line rate; NCCL tuning.cc"
    ),
    "100 Gb/s network": Link(
        "100 Gb/s network", 9.6e-6, 12.5e9, "100 Gb/s line rate; NCCL tuning.cc"
    ),
}
# an assumption, not a measurement: the fraction of the bf16 datasheet peak the GPU
# model computes at
ASSUMED_MFU = 0.4


def ring_all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """The ring all-reduce's time in the alpha-beta model of book/collectives.md."""
    if n < 2:
        return 0.0
    return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes / link.busbw


def gradient_bytes(cfg: GPTConfig, bytes_per_element: int = 4) -> list[int]:
    """Bytes of each parameter's gradient, in ``model.parameters()`` order (fp32
    gradients: DDP all-reduces gradients in the parameters' dtype, fp32 under bf16
    autocast too)."""
    with torch.device("meta"):  # shapes only: GPT-2 small is not allocated
        model = GPT(cfg)
    return [p.numel() * bytes_per_element for p in model.parameters()]


# --- begin buckets ---
def bucket_sizes(
    grad_bytes: list[int],
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_bytes: int | None = None,
) -> list[int]:
    """DDP's buckets in launch order: gradients in reverse ``parameters()`` order
    (backward produces the last layers first); a bucket closes at the first gradient
    that takes it to its cap or past it. ``first_bytes`` caps the first bucket (1 MiB
    when ``bucket_cap_mb`` is not passed)."""
    buckets, current = [], 0
    for size in reversed(grad_bytes):
        current += size
        cap = first_bytes if (first_bytes and not buckets) else cap_bytes
        if current >= cap:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


# --- end buckets ---


def ddp_default_buckets(cfg: GPTConfig) -> list[int]:
    """The buckets DDP uses from the second step on, with its defaults (1 MiB first,
    then 25 MiB)."""
    return bucket_sizes(gradient_bytes(cfg), DEFAULT_CAP_BYTES, FIRST_BUCKET_BYTES)


# --- begin step ---
def ddp_step(
    compute_s: float, buckets: list[int], n: int, link: Link, overlap: bool = True
) -> dict:
    """One DDP step's times (seconds) and its scaling efficiency, compute / step.

    Backward takes 2/3 of ``compute_s`` and produces gradient bytes at a steady rate
    (its FLOPs are proportional to the weights it differentiates); bucket k is ready
    when its last byte is. Buckets are all-reduced one at a time, in order, each as soon
    as it is ready and the previous one is done. ``overlap=False`` is a machine with
    nothing free to communicate while it computes (the CPU cores of this page): every
    bucket then waits for backward to end.
    """
    backward = 2 * compute_s / 3
    total, ready_bytes, comm_end, comm = sum(buckets), 0, 0.0, 0.0
    for nbytes in buckets:
        ready_bytes += nbytes
        ready = backward * ready_bytes / total if overlap else backward
        cost = ring_all_reduce_s(nbytes, n, link)
        comm_end = max(comm_end, ready) + cost
        comm += cost
    exposed = max(0.0, comm_end - backward)
    step = compute_s + exposed
    return {
        "compute": compute_s,
        "comm": comm,
        "exposed": exposed,
        "step": step,
        "efficiency": compute_s / step,
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
    cfg: GPTConfig, batch: int, n: int, link: Link, flops_per_s: float, buckets=None
) -> float:
    buckets = ddp_default_buckets(cfg) if buckets is None else buckets
    return ddp_step(compute_seconds(cfg, batch, flops_per_s), buckets, n, link)[
        "efficiency"
    ]


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
    buckets = ddp_default_buckets(cfg)
    if efficiency(cfg, most, n, link, flops_per_s, buckets) < target:
        return None
    # efficiency grows with the batch: bisect for the first batch that reaches target
    low, high = 0, most
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (
            (low, mid)
            if efficiency(cfg, mid, n, link, flops_per_s, buckets) >= target
            else (mid, high)
        )
    return high


def smallest_batch_from_nccl_tests(
    cfg: GPTConfig,
    n: int,
    busbw_gb_s: float,
    alpha_us: float,
    flops_per_s: float,
    target: float = 0.9,
) -> int | None:
    """``smallest_batch`` for your cluster: ``busbw_gb_s`` is all_reduce_perf's busbw
    column at large sizes (GB/s), ``alpha_us`` its time at the smallest sizes divided by
    2(N-1) (microseconds)."""
    if busbw_gb_s <= 0 or alpha_us < 0:
        raise UserError(
            f"busbw must be positive and alpha not negative, got {busbw_gb_s} "
            f"GB/s and {alpha_us} us"
        )
    link = Link("measured", alpha_us * 1e-6, busbw_gb_s * 1e9, "your nccl-tests run")
    return smallest_batch(cfg, n, link, flops_per_s, target)


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
    pay alpha more often."""
    # 1/8 MiB ... 256 MiB, and the default
    caps_mib = caps_mib or sorted([2.0**k for k in range(-3, 9)] + [25.0])
    compute, grads = compute_seconds(cfg, batch, flops_per_s), gradient_bytes(cfg)
    steps = {
        cap: ddp_step(compute, bucket_sizes(grads, int(cap * MiB)), n, link, overlap)[
            "step"
        ]
        for cap in caps_mib
    }
    return min(steps, key=steps.get), steps


def efficiency_table(
    presets: dict[str, GPTConfig], n: int, flops_per_s: float
) -> list[tuple[str, str, int | None]]:
    """(model, link, smallest batch for 90%) for every preset on every GPU link."""
    return [
        (name, link.name, smallest_batch(cfg, n, link, flops_per_s))
        for (name, cfg), link in itertools.product(presets.items(), GPU_LINKS.values())
    ]
