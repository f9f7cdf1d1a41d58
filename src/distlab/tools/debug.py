"""Tools that find what goes wrong between ranks; the debugging chapter shows each
at work.

    # compares every rank's next collective first
    checked = Lockstep().wrap(dist.all_reduce)
    checked(loss)                      # raises CollectiveMismatch naming each call
    check_replicas(model)              # raises if data-parallel replicas differ
    dump_flight_recorder(folder)       # this rank's recorder buffer, for the analyser
    analyse_flight_recorder(folder)    # torch's analyser on the ranks' recorder dumps

They are debug aids: each costs a collective of its own, so switch them on to hunt
a bug.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import linecache
import logging
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.parallel import first_differing_parameter


# --- begin lockstep ---
class CollectiveMismatch(RuntimeError):
    """Ranks were about to run different collectives."""


class Lockstep:
    """Debug mode for collectives: before each one, all ranks compare what they
    will call.

    Each rank all-gathers a fingerprint of its next collective (a sequence number and a
    hash of op, dtype, shape and the line that calls it) over a gloo group of its own,
    so the checks never pair with the real collectives, even on NCCL. On a difference
    every rank raises, naming each rank's call. Costs one small all-gather per
    collective: a debug mode.
    """

    def __init__(self):
        # every rank must create it, in step
        self.group = dist.new_group(backend="gloo")
        self.count = 0

    def wrap(self, collective):
        @functools.wraps(collective)
        def checked(tensor, *args, **kwargs):
            # frame of the caller
            self.check(collective.__name__, tensor, sys._getframe(1))
            return collective(tensor, *args, **kwargs)

        return checked

    def check(self, op: str, tensor: torch.Tensor, frame) -> None:
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        call = (
            f"#{self.count} {op}({str(tensor.dtype)[6:]}{list(tensor.shape)}) at "
            f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} `{source}`"
        )
        # a hash from hashlib, not hash(): str hashes differ between processes
        # (PYTHONHASHSEED)
        digest = int.from_bytes(
            hashlib.blake2b(call.encode(), digest_size=7).digest(), "little"
        )
        mine = torch.tensor([self.count, digest])
        everyone = [
            torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))
        ]
        dist.all_gather(everyone, mine, group=self.group)
        self.count += 1
        if all(torch.equal(theirs, mine) for theirs in everyone):
            return
        calls = [None] * len(everyone)  # only now send the readable descriptions
        dist.all_gather_object(calls, call, group=self.group)
        raise CollectiveMismatch(
            "ranks are about to run different collectives:\n"
            + "\n".join(f"  rank {r}: {c}" for r, c in enumerate(calls))
        )


# --- end lockstep ---


# --- begin replicas ---
class ReplicasDiverged(RuntimeError):
    """Data-parallel replicas that must be identical are not."""


def check_replicas(model: nn.Module, group=None) -> None:
    """Raise if any parameter differs between ranks: an invariant of data parallelism.

    Compares two fp64 checksums per parameter (sum and sum of squares) with one small
    all-gather: cheap enough to run every few hundred steps. Equal sums do not prove
    equal weights, but replicas that drift apart change them at once.
    """
    # the same checksums that guard fully_shard
    differing = first_differing_parameter(model, group)
    if differing:
        rank, name, theirs, rank0 = differing
        raise ReplicasDiverged(
            f"rank {rank}'s '{name}' differs from rank 0's: sums {theirs:.9g} "
            f"vs {rank0:.9g}"
        )


# --- end replicas ---


# ---------------------------------------------------------------- the flight recorder
def dump_flight_recorder(folder: str) -> None:
    """Write this rank's flight-recorder buffer where torch's analyser expects it
    (``trace_<rank>``)."""
    # torch 2.13's gloo backend records collectives (with TORCH_FR_BUFFER_SIZE > 0) but
    # writes no file on a timeout, as NCCL does; this private call returns the same
    # pickle. Without the Python stacks of the calls: turning them into text imports
    # torch._dynamo on first use, about 3 s on a small CPU
    trace = torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False)
    Path(folder, f"trace_{dist.get_rank()}").write_bytes(trace)


def flight_recorder_entries() -> list[tuple]:
    """This process's recorded collectives, oldest first: (sequence number, operation,
    input sizes, state, duration in ms or None), from NCCL's recorder where torch
    has one."""
    c10d = torch._C._distributed_c10d
    # NCCL records into a recorder of its own, not the one _dump_fr_trace reads (gloo's)
    dump = getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace
    trace = pickle.loads(dump(includeStackTraces=False))
    return [
        (
            e["collective_seq_id"],
            e["profiling_name"],
            e["input_sizes"],
            e["state"],
            e.get("duration_ms"),
        )
        for e in trace["entries"]
    ]


def analyse_flight_recorder(folder: str, prefix: str = "trace_") -> str:
    """Run torch's analyser (the ``torchfrtrace`` command) on the dumps; return
    its report."""
    from torch.distributed.flight_recorder.components.fr_logger import (
        FlightRecorderLogger,
    )
    from torch.distributed.flight_recorder.fr_trace import main

    for path in Path(folder).glob(f"{prefix}*"):
        dump = pickle.loads(path.read_bytes())
        # torch 2.13's gloo recorder leaves the group's name empty in pg_config, and the
        # analyser then stops with KeyError ('0', 0): fill it in from the entries
        if "" in dump["pg_config"] and dump["entries"]:
            name, desc = dump["entries"][0]["process_group"]
            dump["pg_config"] = {
                name: {**dump["pg_config"].pop(""), "name": name, "desc": desc}
            }
            path.write_bytes(pickle.dumps(dump))
    logger = FlightRecorderLogger().logger  # the analyser reports through this logger
    text, saved = io.StringIO(), logger.handlers[:]
    logger.handlers = [logging.StreamHandler(text)]
    try:
        with contextlib.redirect_stdout(text):
            main(["--prefix", prefix, folder])
    finally:
        logger.handlers = saved
    return text.getvalue()
