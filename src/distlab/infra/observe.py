"""Run ranks that are expected to fail, and report what each one saw: notebook plumbing
for pages that break things on purpose (the debugging chapter runs every demo
through it).

    outcome = observe(dying_rank_demo, pg_timeout=2)
    outcome.notes[0]["error"], outcome.notes[0]["waited_s"]  # what rank 0 saw, and when

``observe`` never raises for a failed rank: a demo catches the error it provokes
(``caught``) and returns what it saw; since a killed rank returns nothing, it also
``note``s it into a folder that ``observe`` makes and reads back.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from distlab.infra.launch import LaunchTimeout, RankFailed, run_ranks
from distlab.runtime import rank_world


# ---------------------------------------------------------------- inside the ranks
def note(report: str, **fields) -> None:
    """Add ``fields`` to this rank's notes (``<report>/rank<r>.json``)."""
    # before the rank joins a group too: torchrun's RANK
    path = Path(report, f"rank{rank_world()[0]}.json")
    notes = json.loads(path.read_text()) if path.exists() else {}
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({**notes, **fields}))
    partial.replace(path)  # atomic: a reader (wait_for_pids) never sees half a file


@dataclass
class Caught:
    """What ``caught`` saw: the error (None if there was none) and how long the
    block ran."""

    error: str | None = None
    waited_s: float = 0.0


@contextlib.contextmanager
def caught(report: str):
    """Run the block; if it raises, note the error and how long the rank waited, and
    go on.

    The demos catch their own failures and return, instead of letting the launch fail: a
    rank that returns while its peer fails can keep the launcher waiting, and a failed
    launch costs seconds more (the launcher's error log imports torch._dynamo).
    """
    box, start = Caught(), time.perf_counter()
    try:
        yield box
    except Exception as err:
        box.error, box.waited_s = (
            f"{type(err).__name__}: {err}",
            time.perf_counter() - start,
        )
        note(report, error=box.error, waited_s=box.waited_s)


def stuck(seconds: float) -> None:
    """Stand in for a rank that is busy or blocked (a slow disk, a lock, a
    stuck loader).

    Sleeps in short slices: Python runs a signal handler only between bytecodes of the
    main thread, so a long ``time.sleep`` can ignore the launcher's SIGTERM when the
    kernel hands the signal to one of gloo's threads; then the launcher waits 30 s
    before SIGKILL.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)


# ---------------------------------------------------------------- in the notebook
@dataclass
class Outcome:
    """One launch: its wall time, how it ended, and every rank's notes."""

    wall_s: float
    # the launcher's one-line summary, or None if every rank finished
    failure: str | None
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
    ``while_running(report)``, if given, is called in this process while the ranks run
    (the debugging chapter uses it to signal a hung rank and to run py-spy on it); what
    it returns is in the outcome's notes under -1.
    """
    with contextlib.ExitStack() as stack:
        report = folder or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="distlab-debug-")
        )
        looked, failure, failed_rank, results = {}, None, None, None
        start = time.perf_counter()
        worker = None
        if while_running is not None:
            worker = threading.Thread(
                target=lambda: looked.update(seen=while_running(report))
            )
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
        notes = {
            int(p.stem[4:]): json.loads(p.read_text())
            for p in Path(report).glob("rank*.json")
        }
        if looked:
            notes[-1] = looked["seen"]
        return Outcome(wall, failure, failed_rank, results, notes)


def wait_for_pids(report: str, nprocs: int = 2, timeout: float = 30) -> list[int]:
    """The process ids that the ranks noted (``note(report, pid=...)``), once
    all have."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids = {}
        for path in Path(report).glob("rank*.json"):
            # a file being written: read it next time
            with contextlib.suppress(ValueError):
                pids[int(path.stem[4:])] = json.loads(path.read_text()).get("pid")
        if len(pids) == nprocs and all(pids.values()):
            return [pids[r] for r in range(nprocs)]
        time.sleep(0.05)
    raise TimeoutError(f"the ranks did not note their pids within {timeout} s")
