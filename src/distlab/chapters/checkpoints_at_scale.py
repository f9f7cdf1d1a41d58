"""Saving at scale: ``dcp.async_save`` against ``dcp.save``, ``StateDictOptions``,
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
    sizes = {}
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
        edited = time.perf_counter() - start
        future.result()  # a concurrent.futures.Future; result() re-raises a failed save
        rows["async_total"].append(time.perf_counter() - start)
        sizes["train_ms"] = 1000 * (edited - rows["async_blocked"][-1])
    # load the last async checkpoint back into the (since changed) model: the weights at
    # the call?
    loaded = get_model_state_dict(model)
    dcp.load({"app": {"model": loaded}}, checkpoint_id=folder / f"async_{REPEATS - 1}")
    snapshot_kept = all(torch.equal(loaded[k].to_local(), before[k]) for k in before)
    return {k: statistics.median(v) for k, v in rows.items()} | {
        "snapshot_kept": snapshot_kept,
        "runs": rows,
        "train_ms": sizes["train_ms"],
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
    return out


def save_timeline(saves: dict):
    """Two bars per save, from this run's recorded medians: what blocks the training
    loop (dark) and what runs in the background (light)."""
    import matplotlib.pyplot as plt

    ms = {k: 1000 * saves[k] for k in ("save", "async_blocked", "async_total")}
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    ax.barh(1, ms["save"], color="#c0392b", label="training blocked")
    ax.barh(0, ms["async_blocked"], color="#c0392b")
    ax.barh(
        0,
        ms["async_total"] - ms["async_blocked"],
        left=ms["async_blocked"],
        color="#f5b7b1",
        label="background write",
    )
    ax.text(ms["async_blocked"] / 2, -0.5, "staging", ha="center", fontsize=13)
    ax.set_yticks([0, 1], ["async_save", "dcp.save"], fontsize=14)
    ax.tick_params(axis="x", labelsize=13)
    ax.set_xlabel("ms after the call (median of 3)", fontsize=13)
    ax.set_ylim(-0.75, 1.5)
    ax.legend(
        fontsize=13,
        loc="upper center",
        bbox_to_anchor=(0.4, -0.4),
        ncol=1,
        frameon=False,
    )
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


# --- begin staging ---
def staging_flags_on_cpu() -> dict:
    """What each StagingOptions flag does on a machine without an accelerator: staged
    by a DefaultStager of that one flag (the others off), twice with one stager."""
    import warnings

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    names = ("use_pinned_memory", "use_shared_memory", "use_async_staging")
    names += ("use_non_blocking_copy",)
    state = {"w": torch.arange(6.0)}
    out = {}
    for name in names:
        options = StagingOptions(**{n: n == name for n in names})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                stager = DefaultStager(options)
            except AssertionError:
                out[name] = {"result": "AssertionError"}
                continue
        first = stager.stage(state)
        first = first.result() if hasattr(first, "result") else first
        again = stager.stage(state)
        again = again.result() if hasattr(again, "result") else again
        stager.close()
        out[name] = {
            "result": "staged",
            "copy": torch.equal(first["w"], state["w"])
            and first["w"].data_ptr() != state["w"].data_ptr(),
            "reused": first["w"].data_ptr() == again["w"].data_ptr(),
            "warned": any("pin" in str(w.message) for w in caught),
        }
    return out


# --- end staging ---
