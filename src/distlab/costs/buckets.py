"""DDP's gradient buckets and when their all-reduces run: the one schedule the DDP step
model (``tools.step_model``) and the planner both use.

    sizes = bucket_sizes(grad_bytes)              # per-gradient sizes, DDP's rule
    sizes = steady_buckets(total_bytes)           # a gradient stream, DDP's caps
    timeline(backward_s, sizes, ready, cost, overlap)

A bucket's all-reduce starts when its last gradient is ready and the previous bucket's
has finished (one communication stream); what still runs when backward ends is exposed
(book/ddp_overlap.md).
"""

from __future__ import annotations

import itertools

MiB = 2**20
FIRST_BUCKET_BYTES = 1 * MiB  # dist._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket
DEFAULT_CAP_BYTES = 25 * MiB  # DDP's bucket_cap_mb default


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


def steady_buckets(
    total_bytes: float,
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_bytes: int = FIRST_BUCKET_BYTES,
) -> list[float]:
    """Buckets of a model known only by its gradient bytes (the planner's): the first
    of ``first_bytes``, then full buckets of ``cap_bytes``, then the rest."""
    first = min(first_bytes, total_bytes)
    full, last = divmod(total_bytes - first, cap_bytes)
    return [first] + [cap_bytes] * int(full) + ([last] if last else [])


def steady_ready(sizes: list[float]) -> list[float]:
    """The fraction of backward at which each bucket is ready when backward makes
    gradient bytes at a steady rate."""
    done = list(itertools.accumulate(sizes))
    return [d / done[-1] for d in done]


# --- begin timeline ---
def timeline(
    backward_s: float,
    sizes: list[float],
    ready: list[float],
    cost,
    overlap: bool = True,
) -> dict:
    """Each bucket's (ready, start, end) from backward's start, on one stream: bucket k
    is ready at ``ready[k]`` of backward (``overlap`` False: nothing can communicate
    while the machine computes, so every bucket waits for backward's end) and takes
    ``cost(size)`` seconds. ``comm``: the seconds on the wire; ``exposed``: what runs
    past backward's end."""
    end, spans = 0.0, []
    for size, fraction in zip(sizes, ready):
        at = backward_s * fraction if overlap else backward_s
        start = max(end, at)
        end = start + cost(size)
        spans.append((at, start, end))
    return {
        "spans": spans,
        "comm": sum(e - s for _, s, e in spans),
        "exposed": max(0.0, end - backward_s),
    }


# --- end timeline ---
