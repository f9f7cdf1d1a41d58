"""The ``step_NNNNNN`` folders of ``OUT/checkpoints``: which are finished, which is the
newest, which ``--resume`` names, which to delete, and whether one is complete (checked
without loading a tensor)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from distlab.checkpoint.state import METADATA, STATE_FILE, error_line
from distlab.errors import UserError


def inspect_checkpoint(path: str | Path):
    """(train_state, DCP metadata) of a finished checkpoint, checked without loading a
    tensor: its files exist and none is shorter than the index says. Raises UserError
    naming the file."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"no checkpoint at {path} (no such folder)")
    for name in (METADATA, STATE_FILE):
        if not (path / name).is_file():
            raise UserError(
                f"{path / name} is missing: {path} is not a finished checkpoint"
            )
    try:
        train_state = json.loads((path / STATE_FILE).read_text())
    except ValueError as err:
        raise UserError(
            f"{path / STATE_FILE} is unreadable ({error_line(err)})"
        ) from None
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # a truncated pickle raises EOFError, UnpicklingError, ...
        raise UserError(
            f"{path / METADATA} is unreadable ({error_line(err)}): the "
            "checkpoint is damaged"
        ) from None
    needed: dict[str, int] = {}  # file -> bytes the index points into
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise UserError(f"{file} is missing: the checkpoint is incomplete")
        if file.stat().st_size < size:
            raise UserError(
                f"{file} is truncated: {file.stat().st_size:,} bytes, its index "
                f"({METADATA}) needs {size:,}"
            )
    return train_state, metadata


# --- begin durable ---
def write_durably(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a power cut leaves the old file or the new
    one, never an empty one: a temporary file, flushed and fsynced, then renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # the bytes reach the disk before the name does
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make the names in folder ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- end durable ---


def finished(
    checkpoint_dir: str | Path, holds: tuple[str, ...] = (METADATA, STATE_FILE)
) -> list[Path]:
    """The finished checkpoints in ``checkpoint_dir``, oldest first: ``step_N`` folders
    holding the files ``holds`` names (``.partial`` folders never match)."""
    done = [
        p
        for p in Path(checkpoint_dir).glob("step_*")
        if p.name[5:].isdigit() and all((p / name).is_file() for name in holds)
    ]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest(
    checkpoint_dir: str | Path, holds: tuple[str, ...] = (METADATA, STATE_FILE)
) -> Path | None:
    """The finished checkpoint with the most steps in ``checkpoint_dir``, or None."""
    return (finished(checkpoint_dir, holds) or [None])[-1]


def resume_point(
    resume: str,
    checkpoint_dir: str | Path,
    holds: tuple[str, ...] = (METADATA, STATE_FILE),
    warn=print,
) -> Path | None:
    """The checkpoint ``--resume`` names: a folder, ``latest`` (there must be one) or
    ``auto`` (the latest if there is one, else None: start at step 0). None for an
    empty ``resume``. ``latest`` and ``auto`` take the newest DCP checkpoint that
    ``inspect_checkpoint`` can read; ``warn`` gets a line for each newer one skipped.
    With other ``holds`` (another save protocol's markers), the newest finished one."""
    if not resume:
        return None
    if resume not in ("latest", "auto"):
        return Path(resume)
    done = finished(checkpoint_dir, holds)
    if holds == (METADATA, STATE_FILE):  # a DCP checkpoint: read it before trusting it
        found = newest_readable(done, warn)
    else:  # another protocol's markers: finished is all that can be checked
        found = done[-1] if done else None
    if found is None and done:
        raise UserError(
            f"--resume {resume}: no readable checkpoint among the {len(done)} "
            f"finished in {checkpoint_dir}"
        )
    if found is None and resume == "latest":
        raise UserError(
            f"--resume latest: no finished checkpoint in {checkpoint_dir} "
            "(--resume auto starts from step 0 when there is none)"
        )
    return found


# --- begin fallback ---
def newest_readable(done: list[Path], warn=print) -> Path | None:
    """The newest of ``done`` (oldest first) that ``inspect_checkpoint`` accepts;
    one ``warn`` line per newer one it skips."""
    for path in reversed(done):
        try:
            inspect_checkpoint(path)
        except UserError as err:
            warn(f"warning: skipping unreadable checkpoint {path.name}: {err}")
            continue
        return path
    return None


# --- end fallback ---


# what rank 0 prints when a preemption's checkpoint is saved and the run stops
PREEMPTED = (
    "preempted after step {steps}: checkpoint saved, stopping; the same command with "
    "--resume auto goes on"
)


def save_due(step: int, every: int) -> bool:
    """A checkpoint after optimizer step ``step`` with ``--checkpoint-every every``
    (0: never)?"""
    return every > 0 and (step + 1) % every == 0


def prune(
    checkpoint_dir: str | Path,
    keep: int,
    holds: tuple[str, ...] = (METADATA, STATE_FILE),
) -> list[Path]:
    """Delete all but the ``keep`` newest finished checkpoints (keep 0: delete none);
    returns what it deleted. Unfinished ``.partial`` folders are left to the next save
    of their step."""
    done = finished(checkpoint_dir, holds)
    old = done[:-keep] if keep > 0 else []
    for path in old:
        shutil.rmtree(path)
    return old


def keep_earlier_metrics(out: str | Path, step: int) -> None:
    """On resume: the lab reopens OUT/metrics.jsonl for writing; keep the interrupted
    run's lines aside."""
    old = Path(out) / "metrics.jsonl"
    if old.is_file():
        kept = old.rename(old.with_name(f"metrics.before_step_{step:06d}.jsonl"))
        print(f"kept the earlier {old.name} as {kept.name}", flush=True)
