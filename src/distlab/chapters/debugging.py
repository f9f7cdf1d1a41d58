"""Failures of distributed training reproduced on purpose, and the small tools that find them.

The debugging chapter runs every ``*_demo`` function here on 2 gloo ranks with a process-group
timeout of a few seconds, so each failure ends quickly instead of hanging:

    outcome = observe(dying_rank_demo, pg_timeout=2)
    outcome.notes[0]["error"], outcome.notes[0]["waited_s"]   # what rank 0 saw, and when

The demos catch the errors they provoke and return what they saw; since a killed rank returns
nothing, they also ``note`` it into a folder that ``observe`` makes and reads back. The tools
that find the causes (``Lockstep``, ``check_replicas``, ``analyse_flight_recorder``) are in
``distlab.tools.debug``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pickle
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.infra.launch import LaunchTimeout, RankFailed, run_ranks
from distlab.runtime import init_distributed
from distlab.tools.debug import Lockstep, check_replicas


# ---------------------------------------------------------------- what the ranks saw
def note(report: str, **fields) -> None:
    """Add ``fields`` to this rank's notes (``<report>/rank<r>.json``)."""
    path = Path(report, f"rank{dist.get_rank()}.json")
    notes = json.loads(path.read_text()) if path.exists() else {}
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({**notes, **fields}))
    partial.replace(path)  # atomic: a reader (wait_for_pids) never sees half a file


@dataclass
class Caught:
    """What ``caught`` saw: the error (None if there was none) and how long the block ran."""

    error: str | None = None
    waited_s: float = 0.0


@contextlib.contextmanager
def caught(report: str):
    """Run the block; if it raises, note the error and how long the rank waited, and go on.

    The demos catch their own failures and return, instead of letting the launch fail: a
    rank that returns while its peer fails can keep the launcher waiting, and a failed
    launch costs seconds more (the launcher's error log imports torch._dynamo).
    """
    box, start = Caught(), time.perf_counter()
    try:
        yield box
    except Exception as err:
        box.error, box.waited_s = f"{type(err).__name__}: {err}", time.perf_counter() - start
        note(report, error=box.error, waited_s=box.waited_s)


def stuck(seconds: float) -> None:
    """Stand in for a rank that is busy or blocked (a slow disk, a lock, a stuck loader).

    Sleeps in short slices: Python runs a signal handler only between bytecodes of the main
    thread, so a long ``time.sleep`` can ignore the launcher's SIGTERM when the kernel hands
    the signal to one of gloo's threads; then the launcher waits 30 s before SIGKILL.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)


@dataclass
class Outcome:
    """One launch: its wall time, how it ended, and every rank's notes."""

    wall_s: float
    failure: str | None  # the launcher's one-line summary, or None if every rank finished
    failed_rank: int | None
    results: list | None
    notes: dict[int, dict] = field(default_factory=dict)


def observe(
    fn,
    *args,
    pg_timeout: float = 2.0,
    timeout: float = 60,
    nprocs: int = 2,
    init_group: bool = True,
    while_running=None,
    folder: str | None = None,
) -> Outcome:
    """Run ``fn(report, *args)`` on ``nprocs`` ranks; never raises for a failed rank.

    ``report`` is a fresh temporary folder, or ``folder`` (kept afterwards) if given.
    ``while_running(report)``, if given, is called in this process while the ranks run (the
    chapter uses it to signal a hung rank and to run py-spy on it); what it returns is in
    the outcome's notes under -1.
    """
    with contextlib.ExitStack() as stack:
        report = folder or stack.enter_context(tempfile.TemporaryDirectory(prefix="distlab-debug-"))
        looked, failure, failed_rank, results = {}, None, None, None
        start = time.perf_counter()
        worker = None
        if while_running is not None:
            worker = threading.Thread(target=lambda: looked.update(seen=while_running(report)))
            worker.start()
        try:
            results = run_ranks(
                fn,
                nprocs=nprocs,
                args=(report, *args),
                timeout=timeout,
                pg_timeout=pg_timeout,
                init_group=init_group,
                quiet=True,
            )
        except RankFailed as err:
            failure, failed_rank = err.summary, err.rank
        except LaunchTimeout as err:
            failure = str(err)
        wall = time.perf_counter() - start
        if worker is not None:
            worker.join(timeout)
        notes = {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(report).glob("rank*.json")}
        if looked:
            notes[-1] = looked["seen"]
        return Outcome(wall, failure, failed_rank, results, notes)


def wait_for_pids(report: str, nprocs: int = 2, timeout: float = 30) -> list[int]:
    """The process ids that the ranks noted (``note(report, pid=...)``), once all have."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids = {}
        for path in Path(report).glob("rank*.json"):
            with contextlib.suppress(ValueError):  # a file being written: read it next time
                pids[int(path.stem[4:])] = json.loads(path.read_text()).get("pid")
        if len(pids) == nprocs and all(pids.values()):
            return [pids[r] for r in range(nprocs)]
        time.sleep(0.05)
    raise TimeoutError(f"the ranks did not note their pids within {timeout} s")


# ---------------------------------------------------------------- a rank that dies
# --- begin dying ---
def dying_rank_demo(report: str, steps: int = 4) -> str:
    """A loop of one all-reduce per step; at step 2, rank 1 is killed."""
    for step in range(steps):
        loss = torch.tensor([2.0 - 0.1 * step])  # stands in for this rank's loss
        if dist.get_rank() == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does
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
    """The class of the default group's CPU backend: under DETAIL, a checking wrapper."""
    pg = dist.distributed_c10d._get_default_group()
    return type(pg._get_backend(torch.device("cpu"))).__name__


def metrics_demo(report: str, timeout_s: float, reread_debug_env: bool, lockstep: bool) -> dict:
    """Rank 0 reduces (loss, grad norm), rank 1 (grad norm, loss): what does each log?"""
    join_group(timeout_s, reread_debug_env)
    try:
        rank = dist.get_rank()
        seen = {"debug_level": dist.get_debug_level().name, "backend": backend_name()}
        if lockstep:
            seen["seconds_per_all_reduce"] = lockstep_cost()  # on correct code, first
        all_reduce = Lockstep().wrap(dist.all_reduce) if lockstep else dist.all_reduce
        loss = torch.tensor([2.10, 2.14][rank])  # plausible values for a small GPT
        grad_norm = torch.tensor([0.84, 0.92][rank])
        with caught(report) as failed:
            seen["logged"] = log_metrics(loss, grad_norm, all_reduce, swapped=(rank == 1))
        return {**seen, "error": failed.error}
    finally:
        dist.destroy_process_group()


def lockstep_cost(repeats: int = 100) -> dict:
    """Seconds per all-reduce of one number, plain and with the lockstep check."""
    checked = Lockstep().wrap(dist.all_reduce)
    times = {}
    for name, all_reduce in (("plain", dist.all_reduce), ("lockstep", checked)) * 2:  # 2nd round counts
        x = torch.ones(1)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            all_reduce(x)
        times[name] = (time.perf_counter() - start) / repeats
    return times


# ---------------------------------------------------------------- replicas that drift apart
class TwoBlocks(nn.Module):
    """Two same-shape layers whose order depends on the input, as in a routed model."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def forward(self, x):  # (B, 4)
        # data-dependent control flow: backward then finishes the two gradients in the
        # opposite order on a rank whose batch went the other way
        return self.b(torch.tanh(self.a(x))) if x.mean() > 0 else self.a(torch.tanh(self.b(x)))


def replicas_demo(report: str, wrapper: str, steps: int = 3, lr: float = 0.1) -> dict:
    """Train TwoBlocks under our HookDDP or torch's DDP, the ranks taking different branches."""
    from distlab.scratch.ddp import HookDDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    if wrapper == "HookDDP":
        model = HookDDP(TwoBlocks())
    else:  # imported here: torch's DDP module imports torch._dynamo, seconds on a small CPU
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(TwoBlocks())
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(8, 4, generator=data).abs() * (1 if rank == 0 else -1)  # rank 1: mean < 0
        model.zero_grad()
        model(x).square().mean().backward()  # HookDDP all-reduces each gradient as it finishes
        with torch.no_grad():  # plain SGD (torch.optim's first step imports torch._dynamo: seconds)
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
    """Rank 0 has seen classes 0..7, rank 1 only 0..5: the two counts differ in length."""
    join_group(timeout_s, reread_debug_env)
    try:
        seen = {"debug_level": dist.get_debug_level().name, "backend": backend_name()}
        labels = torch.arange(8) if dist.get_rank() == 0 else torch.arange(6)
        with caught(report) as failed:
            class_counts(labels)
            dist.barrier()  # a rank whose all-reduce "worked" while its peer's failed fails here
        return {**seen, "error": failed.error, "waited_s": failed.waited_s}
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- monitored barrier
def late_rank_demo(report: str, late_s: float, barrier_timeout_s: float) -> dict:
    """Rank 1 arrives ``late_s`` late at a monitored barrier that waits ``barrier_timeout_s``."""
    if dist.get_rank() == 1:
        stuck(late_s)  # still loading its shard of the data, say
    with caught(report) as failed:
        dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))
    return {"error": failed.error, "waited_s": failed.waited_s}


# ---------------------------------------------------------------- where is it stuck?
def wait_for_data(seconds: float) -> None:
    """The function rank 1 is stuck in, so that its name shows up in stack dumps."""
    stuck(seconds)


# --- begin stacks ---
def hung_job_demo(report: str, watchdog_s: float, stuck_s: float) -> dict:
    """Rank 0 waits in an all-reduce for rank 1, which is stuck in ``wait_for_data``."""
    rank = dist.get_rank()
    stacks = open(Path(report, f"stacks{rank}.txt"), "w")  # stays open: the handlers write to it
    # `kill -USR1 <pid>` now prints every thread's Python stack, and the rank goes on
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    note(report, pid=os.getpid())
    if rank == 1:
        wait_for_data(stuck_s)
        return {}
    # a watchdog: if the all-reduce has not returned within watchdog_s, dump the stacks
    faulthandler.dump_traceback_later(watchdog_s, file=stacks)
    with caught(report) as failed:
        dist.all_reduce(torch.ones(1))
    faulthandler.cancel_dump_traceback_later()
    return {"error": failed.error, "waited_s": failed.waited_s}


# --- end stacks ---


# ---------------------------------------------------------------- flight recorder
# --- begin recorder ---
def dump_flight_recorder(report: str) -> None:
    """Write this rank's flight-recorder buffer where torch's analyser expects it."""
    # torch 2.13's gloo backend records collectives (with TORCH_FR_BUFFER_SIZE > 0) but
    # writes no file on a timeout, as NCCL does; this private call returns the same pickle.
    # Without the Python stacks of the calls: turning them into text imports torch._dynamo
    # on first use, about 3 s on a small CPU
    trace = torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False)
    Path(report, f"trace_{dist.get_rank()}").write_bytes(trace)


def recorded_job_demo(report: str, stuck_s: float, steps: int = 3) -> dict:
    """``steps`` good all-reduces; then rank 0 starts another that rank 1 never joins."""
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


# --- end recorder ---


def nccl_recorder_demo(report: str) -> list:
    """One GPU rank: a few NCCL all-reduces with the flight recorder on; its entries back."""
    for size in (4, 1024, 4):
        dist.all_reduce(torch.ones(size, device="cuda"))
    torch.cuda.synchronize()
    c10d = torch._C._distributed_c10d
    # NCCL records into a recorder of its own, not the one _dump_fr_trace reads (gloo's)
    dump = getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace
    trace = pickle.loads(dump(includeStackTraces=False))
    return [
        (e["collective_seq_id"], e["profiling_name"], e["input_sizes"], e["state"], e.get("duration_ms"))
        for e in trace["entries"]
    ]
