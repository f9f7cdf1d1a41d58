"""Hung workers and stragglers: the elastic timer kills a worker that hangs, and a
detector names the rank whose own work is slow.

``hang_experiments()`` runs on every rank of a ``run_ranks`` group (gloo, 2 ranks): a
toy loop with a gradient all-reduce in which rank 1 sleeps in its own work, timed per
rank and reported by ``StragglerDetector``. ``kill_hung_worker`` runs a worker under a
``LocalTimerServer`` in a child process and lets the server kill it.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
import torch.distributed as dist

from distlab.runtime import rank_world
from distlab.tools.stragglers import StragglerDetector


# --- begin straggler ---
def find_straggler(
    steps: int = 10, every: int = 5, slow_rank: int = 1, delay_s: float = 0.03
) -> dict:
    """A toy training loop with a gradient all-reduce each step; ``slow_rank`` sleeps
    ``delay_s`` in its own work. Returns the detector's last report, and the whole-step
    times for contrast."""
    rank, _ = rank_world()
    detector = StragglerDetector(every=every)
    weight, grad = torch.randn(256, 256), torch.zeros(256, 256)
    whole_steps, own, report = [], [], None
    for step in range(steps):
        start = time.perf_counter()
        # this rank's own work (forward and backward in a real loop)
        grad.copy_(weight @ weight)
        if rank == slow_rank:
            time.sleep(delay_s)  # a slow disk, a throttled CPU, a noisy neighbour
        own.append(time.perf_counter() - start)
        detector.record(own[-1])
        # waits for the slowest rank: everyone's step is now as long as its
        dist.all_reduce(grad)
        whole_steps.append(time.perf_counter() - start)
        if detector.due(step):
            report = detector.check()
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, own)  # for the figure: each rank's own times
    return report | {
        "whole_step_s": statistics.median(whole_steps[1:]),
        "own_s": every_rank,
    }


# --- end straggler ---


def detector_on_fixed_times(own_s: tuple[float, ...] = (0.001, 0.031)) -> dict:
    """The detector's report when rank r recorded ``own_s[r]`` (a fixed input, no
    clock): the page's straggler run without its timings, which a busy machine may blur.
    """
    rank, _ = rank_world()
    detector = StragglerDetector(every=1)
    detector.record(own_s[rank % len(own_s)])
    return detector.check()


# --- begin timer ---
def _worker(requests, progress, hang_at: int, limit_s: float) -> None:
    """A training loop whose every step must finish within ``limit_s``; step ``hang_at``
    never does."""
    from torch.distributed.elastic import timer

    # sends (pid, scope, deadline) to the server
    timer.configure(timer.LocalTimerClient(requests))
    for step in range(hang_at + 1):
        with timer.expires(after=limit_s):  # acquire on entry, release on exit
            progress.put((step, time.time()))
            if step == hang_at:
                # alive, not progressing: a hang (a collective that never returns)
                threading.Event().wait()


def kill_hung_worker(
    hang_at: int = 2, limit_s: float = 1.0, timeout_s: float = 30
) -> dict:
    """Run ``_worker`` in a child process under a LocalTimerServer; returns when it
    hung, when it died, and its exit code (-9: SIGKILL, sent by the server's
    watchdog thread)."""
    import multiprocessing as mp

    from torch.distributed.elastic import timer

    ctx = mp.get_context("spawn")
    requests, progress = ctx.Queue(), ctx.Queue()
    # checks deadlines every 0.1 s
    server = timer.LocalTimerServer(requests, max_interval=0.1)
    server.start()
    worker = ctx.Process(target=_worker, args=(requests, progress, hang_at, limit_s))
    try:
        worker.start()
        # the demo's own limit: the timer should act long before it
        worker.join(timeout_s)
        # else the finally below kills it
        died, killed_by_timer = time.time(), not worker.is_alive()
        steps = [progress.get(timeout=1) for _ in range(hang_at + 1)]
    finally:
        if worker.is_alive():
            worker.kill()
        server.stop()
    return {
        "steps_started": len(steps),
        "exitcode": worker.exitcode,
        "killed_by_timer": killed_by_timer,
        "killed_after_s": died - steps[-1][1],
        "limit_s": limit_s,
    }


# --- end timer ---


def hang_experiments() -> dict:
    """What the page measures in one launch of ranks."""
    rank, _ = rank_world()
    return {
        "rank": rank,
        "straggler": find_straggler(),
        "straggler_fixed": detector_on_fixed_times(),
    }


def straggler_figure(report: dict):
    """Each rank's own work per step (ms), from the run; the rank the detector names
    is drawn in red."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.4, 3.4))
    for rank, times in enumerate(report["own_s"]):
        slow = rank in report["slow_ranks"]
        ax.plot(
            [1000 * t for t in times],
            marker="o",
            color="#c0392b" if slow else "#2e86c1",
            label=f"rank {rank}" + (" (flagged)" if slow else ""),
        )
    ax.set_xlabel("step", fontsize=13)
    ax.set_ylabel("own work, ms", fontsize=13)
    ax.tick_params(labelsize=12)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=13, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig
