"""Timestamps of a data-parallel step: when each gradient bucket became ready, when its
all-reduce was launched, when it completed and when the step waited for it, against the
backward pass.

The recorder for torch's DDP is a comm hook; the one for the book's from-scratch
BucketedDDP is ``TimedBucketedDDP`` in ``distlab.chapters.ddp_overlap`` (a subclass:
neither wrapper's code changes):

    timeline = Timeline()
    ddp.register_comm_hook(timeline, timestamping_hook)  # torch's DDP
    timeline.watch_gradients(module)  # when each .grad is complete

Times are ``time.perf_counter()`` seconds on this rank's CPU clock. On gloo the
all-reduce runs on gloo's own threads, and the future it returns is completed there: the
"done" time is when the reduced bucket really was there. On a GPU the same CPU clock
would give launch times of kernels that run later on another stream (see the page,
book/ddp_overlap.md).
"""

# no "from __future__ import annotations": DDP checks a comm hook's annotations against
# the real types (DistributedDataParallel._check_comm_hook), and that import turns them
# into strings
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class Timeline:
    """Events of one rank, ``(what, index, seconds)``: a bucket event of EVENTS (or
    ``wait``) with its bucket, ``grad`` with the parameter's index, or a phase of the
    step (``forward``, ``backward``...) with -1."""

    events: list[tuple[str, int, float]] = field(default_factory=list)
    bucket_bytes: dict[int, int] = field(default_factory=dict)
    # "done" is recorded on gloo's threads
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mark(self, what: str, bucket: int = -1) -> float:
        now = time.perf_counter()
        with self._lock:
            self.events.append((what, bucket, now))
        return now

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def watch_gradients(self, module: nn.Module) -> None:
        """Record when each parameter's gradient is complete (a tick on the
        compute row)."""
        index = {p: i for i, p in enumerate(module.parameters())}

        def tick(p: torch.Tensor) -> None:  # a hook that returns something is an error
            self.mark("grad", index[p])

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(tick)


EVENTS = ("ready", "launch", "done", "waited")  # per bucket, in this order in time


# --- begin torch recorder ---
def timestamping_hook(
    timeline: Timeline, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that does what DDP does without one (average by an all-reduce),
    and records when DDP called it (the bucket is ready and every bucket before it
    launched) and when it completed."""
    index = bucket.index()
    timeline.mark("launch", index)
    buffer = bucket.buffer()
    timeline.bucket_bytes[index] = buffer.numel() * buffer.element_size()
    buffer.div_(dist.get_world_size())

    def done(fut: torch.futures.Future) -> torch.Tensor:
        timeline.mark("done", index)
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(done)


# --- end torch recorder ---


def step_times(events: list, origin: float) -> dict:
    """One recorded step as milliseconds since ``origin``: phases, gradient ticks and
    per-bucket events."""
    ms = {"grads": [], **{what: {} for what in EVENTS}}
    for what, bucket, t in events:
        t = 1000 * (t - origin)
        if what == "grad":
            ms["grads"].append(t)
        elif what in EVENTS:
            ms[what][bucket] = t
        elif bucket == -1:
            ms[what] = t
    return ms


def draw_timeline(ax, ranks: list[dict], title: str) -> None:
    """One step of every rank on ``ax``: a compute row per rank (backward, a tick per
    gradient), then a lane per bucket with one bar per rank from launch to done, a dot
    when the bucket became ready and a cross when the step finished waiting for it. The
    ranks share one clock (perf_counter is CLOCK_MONOTONIC on Linux), with 0 at rank 0's
    start of backward."""
    origin = next(t for what, _, t in ranks[0]["events"] if what == "backward")
    steps = [step_times(r["events"], origin) for r in ranks]
    colours = ("tab:blue", "tab:orange")
    labels = []
    for r, ms in enumerate(steps):
        y = len(labels)
        ax.barh(
            y,
            max(ms["grads"]) - ms["backward"],
            left=ms["backward"],
            height=0.6,
            color="0.8",
        )
        ax.vlines(ms["grads"], y - 0.3, y + 0.3, color="0.35", linewidth=0.6)
        ax.plot(ms["synced"], y, marker="|", markersize=14, color="black")
        labels.append(f"rank {r}: backward")
    for b in sorted(steps[0]["launch"]):
        y = len(labels)
        for r, ms in enumerate(steps):
            lane = y - 0.18 + 0.36 * r
            ax.barh(
                lane,
                ms["done"][b] - ms["launch"][b],
                left=ms["launch"][b],
                height=0.32,
                color=colours[r % 2],
            )
            if b in ms["ready"]:
                ax.plot(ms["ready"][b], lane, "o", markersize=3, color="black")
            if b in ms["waited"]:
                ax.plot(ms["waited"][b], lane, "x", markersize=4, color="black")
        labels.append(f"bucket {b}, {ranks[0]['bucket_bytes'][b] / 2**20:.1f} MiB")
    ax.set_yticks(range(len(labels)), labels, fontsize=10)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=11, loc="left")
    ax.tick_params(axis="x", labelsize=10)
    ax.grid(axis="x", alpha=0.3)
