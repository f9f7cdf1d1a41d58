"""Checkpoints at scale: ``dcp.async_save`` against ``dcp.save``, ``StateDictOptions``,
and PyTorch's own format converters beside the book's ``to_plain``.

``checkpoint_experiments(folder)`` runs on every rank of a ``run_ranks`` group (gloo, 2
ranks): the shakespeare preset's GPT (43 MB of fp32 weights) sharded with FSDP2, saved
with ``dcp.save`` and with ``dcp.async_save``; then the same model's state dict under
each ``StateDictOptions``; then, on rank 0 only, the book's converter and PyTorch's
converters run on the saved checkpoint. ``young_interval`` is the fault-tolerance
chapter's save interval.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

from distlab.checkpoint.plain import to_plain
from distlab.checkpoint.state import MODEL_PREFIX, STATE_FILE
from distlab.infra.experiment import gpt
from distlab.parallel import apply_fsdp
from distlab.runtime import rank_world
from distlab.tools.stragglers import StragglerDetector

REPEATS = 3  # each save is timed this many times; the page reports the median


# --- begin young ---
def young_interval(save_s: float, mtbf_s: float) -> tuple[float, float]:
    """(interval, overhead) at Young's optimum (the fault-tolerance chapter's "How often
    to save").

    Waste per second is save_s / tau (saving) + tau / (2 * mtbf_s) (half an interval
    lost per failure); it is smallest at tau = sqrt(2 * save_s * mtbf_s), where it
    equals sqrt(2 * save_s / mtbf_s).
    """
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError(
            f"save time and MTBF must be positive, got {save_s} s and {mtbf_s} s"
        )
    tau = math.sqrt(2 * save_s * mtbf_s)
    return tau, save_s / tau + tau / (2 * mtbf_s)


# --- end young ---


def sharded_gpt(name: str = "shakespeare") -> torch.nn.Module:
    """The preset's GPT, each block and the root sharded with FSDP2 (same seed on
    every rank)."""
    return apply_fsdp(gpt(name, seed=0))


# --- begin async ---
def time_saves(
    model: torch.nn.Module, folder: Path, save_group: dist.ProcessGroup
) -> dict:
    """Seconds the caller is blocked by dcp.save and by dcp.async_save, and until
    async_save's future completes; checks that async_save's snapshot is the state at
    the call."""
    rows = {"save": [], "async_blocked": [], "async_total": []}
    for i in range(REPEATS):
        state = {"app": {"model": get_model_state_dict(model)}}
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=folder / f"sync_{i}")
        rows["save"].append(time.perf_counter() - start)

        state = {"app": {"model": get_model_state_dict(model)}}
        before = {k: v.to_local().clone() for k, v in state["app"]["model"].items()}
        dist.barrier()
        start = time.perf_counter()
        # its collectives run in a background thread: give them a gloo group of their
        # own, so they never interleave with the training loop's collectives on the
        # default group
        future = dcp.async_save(
            state, checkpoint_id=folder / f"async_{i}", process_group=save_group
        )
        rows["async_blocked"].append(time.perf_counter() - start)
        # the training loop goes on and changes the weights in place
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        future.result()  # a concurrent.futures.Future; result() re-raises a failed save
        rows["async_total"].append(time.perf_counter() - start)
    # load the last async checkpoint back into the (since changed) model: the weights at
    # the call?
    loaded = get_model_state_dict(model)
    dcp.load({"app": {"model": loaded}}, checkpoint_id=folder / f"async_{REPEATS - 1}")
    snapshot_kept = all(torch.equal(loaded[k].to_local(), before[k]) for k in before)
    return {k: statistics.median(v) for k, v in rows.items()} | {
        "snapshot_kept": snapshot_kept
    }


# --- end async ---


# --- begin options ---
def state_dict_views(model: torch.nn.Module) -> dict:
    """What this rank holds under each StateDictOptions: keys, value type, bytes,
    wte's shape."""
    views = {}
    for label, options in {
        "default": StateDictOptions(),
        "full_state_dict": StateDictOptions(full_state_dict=True),
        "full_state_dict + cpu_offload": StateDictOptions(
            full_state_dict=True, cpu_offload=True
        ),
        "cpu_offload": StateDictOptions(cpu_offload=True),
    }.items():
        sd = get_model_state_dict(model, options=options)
        local = {
            k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()
        }
        views[label] = {
            "keys": len(sd),
            "type": type(next(iter(sd.values()))).__name__ if sd else "-",
            "bytes": sum(t.numel() * t.element_size() for t in local.values()),
            "wte": tuple(local["wte.weight"].shape) if sd else None,
        }
    return views


# --- end options ---


# --- begin converters ---
def convert_both_ways(checkpoint: Path, folder: Path) -> dict:
    """The book's to_plain and PyTorch's dcp_to_torch_save on one checkpoint; then
    torch_save_to_dcp and back. Each loads the whole model into this one process."""
    from torch.distributed.checkpoint.format_utils import (
        dcp_to_torch_save,
        torch_save_to_dcp,
    )

    start = time.perf_counter()
    ours = to_plain(checkpoint, folder / "ours.pt")
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    dcp_to_torch_save(checkpoint, folder / "torch.pt")
    theirs_s = time.perf_counter() - start
    # PyTorch's file keeps the DCP nesting {"app": {"model": {...}}}; ours is the plain
    # GPT's keys
    theirs = torch.load(folder / "torch.pt", weights_only=True)["app"]["model"]
    torch_save_to_dcp(folder / "torch.pt", folder / "back_to_dcp")
    dcp_to_torch_save(folder / "back_to_dcp", folder / "round_trip.pt")
    round_trip = torch.load(folder / "round_trip.pt", weights_only=True)["app"]["model"]

    def same_bytes(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(
            a[k].dtype == b[k].dtype
            and a[k].shape == b[k].shape
            and torch.equal(a[k].view(-1), b[k].view(-1))
            for k in a
        )

    return {
        "keys": len(ours),
        "bytes": sum(t.numel() * t.element_size() for t in theirs.values()),
        "equal": same_bytes(ours, theirs),
        "round_trip_equal": same_bytes(theirs, round_trip),
        "ours_s": ours_s,
        "theirs_s": theirs_s,
    }


# --- end converters ---


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
    whole_steps, report = [], None
    for step in range(steps):
        start = time.perf_counter()
        # this rank's own work (forward and backward in a real loop)
        grad.copy_(weight @ weight)
        if rank == slow_rank:
            time.sleep(delay_s)  # a slow disk, a throttled CPU, a noisy neighbour
        detector.record(time.perf_counter() - start)
        # waits for the slowest rank: everyone's step is now as long as its
        dist.all_reduce(grad)
        whole_steps.append(time.perf_counter() - start)
        if detector.due(step):
            report = detector.check()
    return report | {"whole_step_s": statistics.median(whole_steps[1:])}


# --- end straggler ---


def detector_on_fixed_times(own_s: tuple[float, ...] = (0.001, 0.031)) -> dict:
    """The detector's report when rank r recorded ``own_s[r]`` (a fixed input, no
    clock): the page's straggler run without its timings, which a busy machine may blur.
    """
    rank, _ = rank_world()
    detector = StragglerDetector(every=1)
    detector.record(own_s[rank % len(own_s)])
    return detector.check()


def checkpoint_experiments(folder: str) -> dict:
    """Everything the page measures, in one launch of ranks; rank 0 also converts."""
    folder = Path(folder)
    rank, world_size = rank_world()
    model = sharded_gpt()
    save_group = dist.new_group(backend="gloo")
    out = {
        "rank": rank,
        "world_size": world_size,
        "saves": time_saves(model, folder, save_group),
    }
    out["views"] = state_dict_views(model)
    dist.barrier()
    if rank == 0:
        checkpoint = folder / "sync_0"
        # what the book's converter reads besides the shards: the preset, as the labs
        # write it
        (checkpoint / STATE_FILE).write_text(
            json.dumps({"config": {"preset": "shakespeare"}})
        )
        out["convert"] = convert_both_ways(checkpoint, folder)
        out["model_prefix"] = MODEL_PREFIX
    dist.barrier()
    dist.destroy_process_group(save_group)
    out["straggler"] = find_straggler()
    out["straggler_fixed"] = detector_on_fixed_times()
    return out


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
