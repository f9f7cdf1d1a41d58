"""Failures of distributed training reproduced on purpose: the experiments of the
debugging page.

The page runs each ``*_demo`` here on 2 gloo ranks with a process-group timeout of a few
seconds, through ``distlab.infra.observe`` (``observe(dying_rank_demo, pg_timeout=2)``),
so each failure ends quickly instead of hanging. The tools that find the causes
(``Lockstep``, ``check_replicas``, the flight recorder's dump and analyser) are in
``distlab.tools.debug``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.infra.observe import caught, note, stuck
from distlab.runtime import init_distributed
from distlab.tools.debug import (
    Lockstep,
    check_replicas,
    dump_flight_recorder,
    flight_recorder_entries,
)


# ---------------------------------------------------------------- a rank that dies
# --- begin dying ---
def dying_rank_demo(report: str, steps: int = 4) -> str:
    """A loop of one all-reduce per step; at step 2, rank 1 is killed."""
    if dist.get_rank() == 0:
        # the launcher SIGTERMs the survivors once it sees rank 1 gone; on a busy
        # machine that can come first: ignore it here, to see what gloo reports
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for step in range(steps):
        loss = torch.tensor([2.0 - 0.1 * step])  # stands in for this rank's loss
        if dist.get_rank() == 1 and step == 2:
            # what the kernel's out-of-memory killer does
            os.kill(os.getpid(), signal.SIGKILL)
        with caught(report) as failed:
            dist.all_reduce(loss)
        if failed.error:
            return failed.error
    return "finished"


# --- end dying ---


# ---------------------------------------------------------------- silent pairing
# --- begin metrics ---
def log_metrics(loss: torch.Tensor, grad_norm: torch.Tensor, all_reduce, swapped: bool):
    """Average this step's loss and grad norm over the ranks, for the log line."""
    if swapped:  # the bug: one rank reaches the two all-reduces in the other order
        all_reduce(grad_norm)
        all_reduce(loss)
    else:
        all_reduce(loss)
        all_reduce(grad_norm)
    n = dist.get_world_size()
    return round(loss.item() / n, 4), round(grad_norm.item() / n, 4)


# --- end metrics ---


def join_group(timeout_s: float, reread_debug_env: bool) -> None:
    """Join the default group ourselves (for a launch with ``init_group=False``).

    ``torch.distributed`` reads TORCH_DISTRIBUTED_DEBUG once, when it is imported; these
    ranks are forked from a process that imported it long before, so without a re-read a
    variable set since then is ignored.
    """
    if reread_debug_env:
        dist.set_debug_level_from_env()
    init_distributed(torch.device("cpu"), timeout_s=timeout_s)


def backend_name() -> str:
    """The class of the default group's CPU backend: under DETAIL, a
    checking wrapper."""
    pg = dist.distributed_c10d._get_default_group()
    return type(pg._get_backend(torch.device("cpu"))).__name__


def metrics_demo(
    report: str, timeout_s: float, reread_debug_env: bool, lockstep: bool
) -> dict:
    """Rank 0 reduces (loss, grad norm), rank 1 (grad norm, loss): what does
    each log?"""
    join_group(timeout_s, reread_debug_env)
    try:
        rank = dist.get_rank()
        seen = {"debug_level": dist.get_debug_level().name, "backend": backend_name()}
        all_reduce = Lockstep().wrap(dist.all_reduce) if lockstep else dist.all_reduce
        loss = torch.tensor([2.10, 2.14][rank])  # plausible values for a small GPT
        grad_norm = torch.tensor([0.84, 0.92][rank])
        with caught(report) as failed:
            seen["logged"] = log_metrics(
                loss, grad_norm, all_reduce, swapped=(rank == 1)
            )
        return {**seen, "error": failed.error}
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------ replicas that drift apart
class TwoBlocks(nn.Module):
    """Two same-shape layers whose order depends on the input, as in a routed model."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def forward(self, x):  # (B, 4)
        # data-dependent control flow: backward then finishes the two gradients in the
        # opposite order on a rank whose batch went the other way
        return (
            self.b(torch.tanh(self.a(x)))
            if x.mean() > 0
            else self.a(torch.tanh(self.b(x)))
        )


def replicas_demo(report: str, wrapper: str, steps: int = 3, lr: float = 0.1) -> dict:
    """Train TwoBlocks under our HookDDP or torch's DDP, the ranks taking
    different branches."""
    from distlab.scratch.ddp import HookDDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    if wrapper == "HookDDP":
        model = HookDDP(TwoBlocks())
    # imported here: torch's DDP module imports torch._dynamo, seconds on a small CPU
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(TwoBlocks())
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        # rank 1: mean < 0
        x = torch.randn(8, 4, generator=data).abs() * (1 if rank == 0 else -1)
        model.zero_grad()
        # HookDDP all-reduces each gradient as it finishes
        model(x).square().mean().backward()
        # plain SGD (torch.optim's first step imports torch._dynamo: seconds)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
        with caught(report) as failed:
            check_replicas(model)
        if failed.error:
            return {"steps": step + 1, "error": failed.error}
    return {"steps": steps, "error": None}


# ---------------------------------------------------------------- mismatched shapes
# --- begin shapes ---
def class_counts(labels: torch.Tensor) -> torch.Tensor:
    """How often each class occurs in this rank's labels, summed over all ranks."""
    counts = torch.bincount(labels).float()  # the bug: its length is max(labels) + 1
    dist.all_reduce(counts)
    return counts


# --- end shapes ---


def shapes_demo(report: str, timeout_s: float, reread_debug_env: bool) -> dict:
    """Rank 0 has seen classes 0..7, rank 1 only 0..5: the two counts differ
    in length."""
    join_group(timeout_s, reread_debug_env)
    try:
        seen = {"debug_level": dist.get_debug_level().name, "backend": backend_name()}
        labels = torch.arange(8) if dist.get_rank() == 0 else torch.arange(6)
        with caught(report) as failed:
            class_counts(labels)
            # a rank whose all-reduce "worked" while its peer's failed fails here
            dist.barrier()
        _wait_for_every_rank("shapes_demo", timeout_s * 10)
        return {**seen, "error": failed.error, "waited_s": failed.waited_s}
    finally:
        dist.destroy_process_group()


def _wait_for_every_rank(key: str, timeout_s: float) -> None:
    """Meet on the store (not the group, which has failed) before leaving: a rank that
    closed its group while its peer still waited would hand the peer "connection
    closed" in place of its own timeout (seen on a loaded machine)."""
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < dist.get_world_size() and time.monotonic() < deadline:
        time.sleep(0.01)


# ---------------------------------------------------------------- monitored barrier
# --- begin budget ---
def barrier_budget_demo(report: str, late_s: tuple, timeout_s: float) -> dict:
    """Two groups of 3 ranks, the same lateness in both: ranks 1 and 2 of each group
    arrive ``late_s`` seconds late. Group 0 waits with the default
    ``wait_all_ranks=False``, group 1 with ``wait_all_ranks=True``."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1, 2]), dist.new_group([3, 4, 5])]
    group, wait_all = groups[rank // 3], rank >= 3
    stuck(late_s[rank % 3])  # rank 0 of each group is on time
    with caught(report) as failed:
        dist.monitored_barrier(
            group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=wait_all
        )
    return {"error": failed.error, "waited_s": failed.waited_s}


# --- end budget ---


# ---------------------------------------------------------------- NaN on one rank
# --- begin nonfinite ---
def nonfinite_demo(report: str) -> dict:
    """Rank 1's batch is all zeros (padding, say): its loss is finite, its gradient
    is NaN, and the all-reduce hands the NaN to every rank."""
    rank = dist.get_rank()
    w = torch.ones(4, requires_grad=True)
    x = torch.ones(4) if rank == 0 else torch.zeros(4)
    # a norm written by hand: sqrt's gradient is inf at 0, and inf * 0 is NaN
    loss = (w * x).pow(2).sum().sqrt()
    loss.backward()
    grad = w.grad.clone()
    # the per-rank check, before the all-reduce mixes the ranks
    mine = torch.tensor([loss.item(), float(torch.isfinite(grad).all())])
    every = [torch.empty(2) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    dist.all_reduce(grad)  # what DDP does to every gradient
    seen = {"loss": loss.item(), "finite_before": bool(torch.isfinite(w.grad).all())}
    seen["finite_after"] = bool(torch.isfinite(grad).all())
    seen["bad_ranks"] = [r for r, (_, ok) in enumerate(every) if not ok]
    with caught(report) as failed, torch.autograd.detect_anomaly():
        # anomaly mode names the operation whose backward made the NaN
        (w * x).pow(2).sum().sqrt().backward()
    return {**seen, "anomaly": failed.error}


# --- end nonfinite ---


# ---------------------------------------------------------------- where is it stuck?
def wait_for_data(seconds: float, release: Path | None = None) -> None:
    """Where rank 1 is stuck, named so in stack dumps: ``seconds``, or until the file
    ``release`` exists."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (release and release.exists()):
        time.sleep(0.05)


# --- begin stacks ---
def hung_job_demo(report: str, watchdog_s: float, stuck_s: float) -> dict:
    """Rank 0 waits in an all-reduce for rank 1, stuck in ``wait_for_data`` until
    ``report``/release exists."""
    rank = dist.get_rank()
    # stays open: the handlers write to it
    stacks = open(Path(report, f"stacks{rank}.txt"), "w")
    # `kill -USR1 <pid>` now prints every thread's Python stack, and the rank goes on
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    note(report, pid=os.getpid())
    if rank == 1:
        wait_for_data(stuck_s, release=Path(report, "release"))
        dist.all_reduce(torch.ones(1))  # released: it joins rank 0's all-reduce at last
        return {}
    # a watchdog: if the all-reduce has not returned within watchdog_s, dump the stacks
    faulthandler.dump_traceback_later(watchdog_s, file=stacks)
    with caught(report) as failed:
        dist.all_reduce(torch.ones(1))
    faulthandler.cancel_dump_traceback_later()
    return {"error": failed.error, "waited_s": failed.waited_s}


# --- end stacks ---


# ---------------------------------------------------------------- flight recorder
def recorded_job_demo(report: str, stuck_s: float, steps: int = 3) -> dict:
    """``steps`` good all-reduces; then rank 0 starts another that rank 1
    never joins."""
    for _ in range(steps):
        dist.all_reduce(torch.ones(4, 4))
    if dist.get_rank() == 1:
        dump_flight_recorder(report)
        wait_for_data(stuck_s)  # rank 1 skips the next all-reduce: busy elsewhere
        return {}
    with caught(report) as failed:
        dist.all_reduce(torch.ones(4, 4))  # rank 1 never comes
    dump_flight_recorder(report)
    return {"error": failed.error, "waited_s": failed.waited_s}


def nccl_recorder_demo(report: str) -> list:
    """One GPU rank: a few NCCL all-reduces with the flight recorder on; its
    entries back."""
    for size in (4, 1024, 4):
        dist.all_reduce(torch.ones(size, device="cuda"))
    torch.cuda.synchronize()
    return flight_recorder_entries()


# --------------------------------------------------------------- a job that never exits
def exit_demo(report: str, free_model_first: bool, peer_delay_s: float = 2.0) -> dict:
    """Rank 0 destroys its group while a gloo worker still owns a Python tensor.

    ``dist.destroy_process_group()`` forgets the group, but a DDP model still holds it
    (through its C++ reducer), so the group is really destroyed later, when the model is
    freed. Freed from there, torch 2.13 destroys a gloo group while holding Python's
    GIL; the destructor waits for gloo's worker threads, and a worker that is releasing
    the last reference to a tensor made in Python needs the GIL to do so: a deadlock.
    Destroyed from Python (``destroy_process_group`` dropping the last reference), the
    GIL is released while it waits. Rank 1 joins the all-reduce ``peer_delay_s`` late,
    so rank 0 is certainly destroying its group while the worker still has the tensor
    (in a real run, a race that a loaded machine loses now and then: 8 of 133 short lab
    2 launches, two at a time on 2 cores, before the labs freed their model first).
    Returns the teardown's duration and end, and how often a Python thread ran
    meanwhile; notes when rank 0's teardown started and when rank 1 arrived.
    """
    # imports torch._dynamo: seconds
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    note(report, pid=os.getpid())  # so that the chapter can point py-spy at a hung rank
    model = DDP(nn.Linear(4, 4))  # its reducer holds a reference to the group
    if rank == 1:
        stuck(peer_delay_s)
        # one clock for every process of this machine
        note(report, arrived=time.monotonic())
    work = dist.all_reduce(torch.ones(4), async_op=True)
    if rank == 1:
        work.wait()
        del model
        dist.destroy_process_group()
        note(report, finished=True)
        return {}
    del work  # from here on only gloo's worker thread holds the tensor

    ticks = 0  # a Python thread that counts while the GIL is free
    done = threading.Event()

    log = open(Path(report, "ticks.txt"), "w")  # read back even if rank 0 is killed

    def count() -> None:
        nonlocal ticks
        while not done.wait(0.01):
            ticks += 1
            log.write(f"{time.monotonic()}\n")
            log.flush()

    threading.Thread(target=count, daemon=True).start()

    start = time.monotonic()
    note(report, teardown_started=start)
    # --- begin exit order ---
    if free_model_first:
        # the reducer lets go; the group is still registered, so nothing is
        # destroyed yet
        del model
        # the last reference, dropped from Python: GIL released
        dist.destroy_process_group()
    else:
        # the tutorial order: the group lives on in the reducer ...
        dist.destroy_process_group()
        del model  # ... and is destroyed here, GIL held: hangs
    # --- end exit order ---
    end = time.monotonic()
    done.set()
    return {
        "teardown_s": end - start,
        "teardown_ended": end,
        "python_ticks_during_teardown": ticks,
    }
