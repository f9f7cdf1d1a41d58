"""Resume and fault tolerance, exercise 4: kill rank 1 in the middle of writing its
shard file."""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from distlab.chapters.fault_tolerance import kill_when_stalled
from distlab.checkpoint import latest
from distlab.exercises._common import on_ranks, passed, require_callable
from distlab.infra.launcher import script_entry
from distlab.infra.paths import REPO_ROOT

LAB2 = REPO_ROOT / "src" / "labs" / "lab2_ddp.py"
# two steps, a checkpoint after each: save 1 completes (the sizes to expect), save 2
# is killed
LAB2_ARGS = (
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--checkpoint-every",
    "1",
    "--keep-checkpoints",
    "0",
    "--eval-every",
    "1000",
    "--eval-batches",
    "1",
    "--sample-chars",
    "0",
    "--no-progress",
)
STALLED_RANK, STALLED_SAVE = 1, 2


def _lab2_rank(stall: Callable, marker: Path, out: Path) -> None:
    """One rank of lab 2, as torchrun would start it; rank 1 first installs the
    reader's stall."""
    if int(os.environ["RANK"]) == STALLED_RANK:
        stall(STALLED_SAVE, marker)
    script_entry(str(LAB2), (*LAB2_ARGS, "--out", str(out)))


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.exists() else None


def check_kill_during_shard_writes(stall: Callable, timeout: float = 60) -> None:
    """``stall(save_number, marker)``, called in rank 1 before lab 2 starts, must make
    that rank write part of its shard file in its ``save_number``-th save, then write
    its pid to ``marker`` and wait. The check kills it there and inspects what is left
    on disk."""
    require_callable(stall, "stall", "def stall(save_number, marker): ...")
    with tempfile.TemporaryDirectory(prefix="exercise_kill_") as work:
        _check_in(Path(work), stall, timeout)


def _check_in(work: Path, stall: Callable, timeout: float) -> None:
    marker, out = work / "stalled", work / "run"
    done, partial = (
        out / "checkpoints" / "step_000001",
        out / "checkpoints" / f"step_{STALLED_SAVE:06d}.partial",
    )
    stop = threading.Event()
    rank0_file, complete_file = partial / "__0_0.distcp", done / "__0_0.distcp"

    # the question is what rank 1's death leaves, not a race with rank 0
    def rank0_finished() -> bool:
        return _size(rank0_file) is not None and _size(rank0_file) == _size(
            complete_file
        )

    watcher = kill_when_stalled(marker, timeout, ready=rank0_finished, stop=stop)

    def stalled() -> bool:  # rank 1 wrote its pid, and the watcher kills it then
        return marker.exists() and bool(marker.read_text().strip())

    try:
        on_ranks(
            functools.partial(_lab2_rank, stall, marker, out),
            2,
            "lab 2 with your stall",
            timeout=timeout,
            init_group=False,
        )
    except AssertionError as failure:  # the run must fail: rank 1 is killed
        if not stalled():
            raise AssertionError(
                f"rank {STALLED_RANK} never wrote its pid to the marker, so it "
                f"was never killed: {failure}"
            ) from failure
    finally:
        stop.set()
        watcher.join()
    if not stalled():
        raise AssertionError(
            f"lab 2 finished: your stall never made rank {STALLED_RANK} wait in save "
            f"{STALLED_SAVE} (does it patch a method that every rank calls "
            "while writing?)"
        )
    killed_pid = int(marker.read_text())
    # save 1: complete files of the same tensors
    full = {r: _size(done / f"__{r}_0.distcp") for r in (0, 1)}
    left = {r: _size(partial / f"__{r}_0.distcp") for r in (0, 1)}
    if not partial.is_dir():
        raise AssertionError(
            f"no {partial.name} folder: rank {STALLED_RANK} was killed outside "
            f"save {STALLED_SAVE}"
        )
    if (partial / ".metadata").exists():
        raise AssertionError(
            f"{partial.name} has .metadata: the kill came after every rank had written"
        )
    if left[0] != full[0]:
        raise AssertionError(
            f"rank 0's __0_0.distcp holds {left[0]} bytes of {full[0]}: rank 0 "
            "did not finish"
        )
    if not left[1]:
        raise AssertionError(
            f"rank 1's __1_0.distcp is {'empty' if left[1] == 0 else 'missing'}: "
            "the kill landed before its writes, not during them"
        )
    if left[1] >= full[1]:
        raise AssertionError(
            f"rank 1's __1_0.distcp is complete ({left[1]:,} bytes): the kill "
            "landed after its writes, not during them"
        )
    if latest(out / "checkpoints") != done:
        raise AssertionError(
            f"latest() picks {latest(out / 'checkpoints')}, not {done.name}"
        )
    passed(
        f"rank 1 (pid {killed_pid}) was killed inside its shard writes of save "
        f"{STALLED_SAVE}: {partial.name} "
        f"holds rank 0's complete __0_0.distcp ({left[0]:,} bytes), a partial "
        f"__1_0.distcp ({left[1]:,} of "
        f"{full[1]:,} bytes) and no .metadata; latest() still picks {done.name}"
    )
