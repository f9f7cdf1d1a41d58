r"""Real faults at chosen moments: stall a lab inside a checkpoint save, or SIGKILL a
torchrun worker.

A save that is killed half-way must leave the previous checkpoint loadable. To kill a
save half-way every time (not when a race happens to allow it), this runs a lab with one
of the save's steps made to wait; rank 0 writes its process id to MARKER when it gets
there, and the caller kills that process for real (SIGKILL: no handler, no clean-up, as
a lost node):

    python src/examples/stall_save.py --stall before-rename --save 2 --marker M \
        src/labs/lab2_ddp.py --checkpoint-every 2 ...

Nothing in the labs knows about this: the waits are patched in from outside, here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from distlab.infra.forked_torchrun import TORCHRUN, start_node

# where in a save rank 0 waits; Checkpoints.save runs dcp.save, then writes
# train_state.json and renames
STALLS = {
    # DCP's coordinator (rank 0) writes .metadata after every rank has written its
    # shard file
    "before-metadata": "every rank's shard file written, .metadata not yet",
    # the DCP checkpoint is complete, but the folder still has its .partial name
    "before-rename": (
        "shards and .metadata written, train_state.json not yet, still .partial"
    ),
}


def stall_on(save_number: int, where: str, marker: Path) -> None:
    """Make rank 0 wait, forever, at ``where`` in its ``save_number``-th
    checkpoint save."""
    from torch.distributed.checkpoint import FileSystemWriter

    from distlab.checkpoint import Checkpoints

    if where not in STALLS:
        raise SystemExit(f"--stall must be one of {', '.join(STALLS)}, not {where!r}")
    owner, name = (
        (FileSystemWriter, "finish")
        if where == "before-metadata"
        else (Checkpoints, "_train_state")
    )
    original, calls = getattr(owner, name), [0]

    def patched(*args, **kwargs):
        calls[0] += 1  # both methods run on rank 0 only, once per save
        if calls[0] == save_number:
            marker.write_text(f"{os.getpid()}\n")
            while True:  # until killed
                time.sleep(1)
        return original(*args, **kwargs)

    setattr(owner, name, patched)


def kill_when_stalled(
    marker: Path,
    timeout: float = 120,
    ready: Callable[[], bool] | None = None,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """Start a thread that SIGKILLs the process whose pid ``stall_on`` writes to
    ``marker``, as soon as it is there (or gives up after ``timeout`` seconds, or once
    ``stop`` is set); join it after the run. With ``ready``, the kill also waits (up to
    10 s) until ``ready()`` is true, e.g. until another rank has finished its part of
    the save."""

    def watch():
        deadline = time.monotonic() + timeout
        while not marker.exists() or not marker.read_text().strip():
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                return
            time.sleep(0.02)
        settle = time.monotonic() + 10
        while ready is not None and not ready() and time.monotonic() < settle:
            time.sleep(0.02)
        kill(int(marker.read_text()))

    killer = threading.Thread(target=watch, daemon=True)
    killer.start()
    return killer


def torchrun_worker(
    agent_pid: int, rank: int, logs: str | Path, attempt: int = 0
) -> int | None:
    """The pid of global rank ``rank`` (one node: its local rank) in attempt ``attempt``
    of a torchrun agent (process ``agent_pid``) started with ``--tee`` and ``--log-dir
    logs``: the agent's child whose stdout is that rank's log file,
    ``logs/<run>/attempt_N/<rank>/stdout.log`` (torchrun's layout). A forked worker's
    environment cannot tell: /proc shows the agent's."""
    wanted = f"{os.sep}attempt_{attempt}{os.sep}{rank}{os.sep}stdout.log"
    for child in psutil.Process(agent_pid).children():
        try:
            files = child.open_files()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # it ended while we looked
            continue
        if any(f.path.startswith(str(logs)) and f.path.endswith(wanted) for f in files):
            return child.pid
    return None


def kill(pid: int) -> None:
    """SIGKILL: the process gets no chance to clean up, as when a machine dies."""
    os.kill(pid, signal.SIGKILL)


def torchrun_killing_a_rank(
    script: str | Path,
    args: list,
    after: Path,
    nprocs: int = 2,
    rank: int = 1,
    max_restarts: int = 1,
    timeout: float = 180,
) -> tuple[int, list[tuple[float, str]]]:
    """Run ``torchrun --standalone --max-restarts`` on ``script``; SIGKILL global rank
    ``rank`` as soon as the path ``after`` exists (say, the first checkpoint). Returns
    torchrun's exit code and its output lines (each rank's without torchrun's
    ``[default0]:`` prefix), each with the seconds since the start; a ``KILLED`` line
    marks the kill. Everything is killed if it has not finished after
    ``timeout`` seconds.

    torchrun forks its workers from itself and runs the script in them
    (``--start-method=fork --run-path``): the same agent, rendezvous, store and restarts
    as with a fresh Python per worker, without importing torch again in each of them
    (seconds of CPU per worker). The agent itself is forked from the launchers'
    forkserver (``distlab.infra.forked_torchrun``), which has imported torch and
    torch._dynamo (which DDP imports), so the workers start with them. They compute with
    the threads run_script gives its ranks, so that a run this restarts computes like
    one that run_script ran, bit for bit."""
    start = time.monotonic()
    logs = tempfile.mkdtemp(prefix="torchrun-logs-")
    output = Path(logs) / "torchrun.out"
    output.touch()
    command = [
        *TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nprocs}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        "--start-method=fork",
        "--run-path",
        # each rank's output into a file of its own (which names its rank), and on
        # to ours
        "--tee=3",
        f"--log-dir={logs}",
        str(script),
        *map(str, args),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nprocs)),
    }
    agent = start_node(command, output, output, env=env, cwd=os.getcwd())
    lines: list[tuple[float, str]] = []
    finished = threading.Event()

    def read() -> None:  # follow torchrun's output file as it grows, stamping each line
        with open(output) as f:
            while True:
                line = f.readline()
                if line.endswith("\n"):
                    lines.append(
                        (time.monotonic() - start, _TEE_PREFIX.sub("", line.rstrip()))
                    )
                elif finished.is_set():
                    return
                else:
                    time.sleep(0.01)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        victim = None
        while victim is None:
            if agent.poll() is not None:
                raise RuntimeError(
                    f"torchrun ended (exit code {agent.returncode}) before "
                    f"{after} appeared"
                )
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{after} did not appear within {timeout} s")
            if Path(after).exists():
                victim = torchrun_worker(agent.pid, rank, logs)
            time.sleep(0.01)
        kill(victim)
        lines.append(
            (
                time.monotonic() - start,
                f"KILLED rank {rank} (pid {victim}) with SIGKILL",
            )
        )
        deadline = start + timeout
        while agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if agent.poll() is None:
            # the agent and every worker it started
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        finished.set()
        reader.join(timeout=10)
        shutil.rmtree(logs, ignore_errors=True)
    return agent.returncode, sorted(lines)


# torchrun --tee prefixes each line a rank writes with its role and local rank
_TEE_PREFIX = re.compile(r"^\[default\d+\]:")


# ------------------------------------------------- one real save, every step stamped
def save_events(out: str, steps: tuple[int, ...] = (10, 20)) -> list[dict]:
    """On every rank of a gloo group: the tiny model under DDP, its AdamW state, and
    ``Checkpoints.save`` after each of ``steps``, the real one, with each step of the
    last save stamped on the shared monotonic clock. Returns this rank's events: name,
    start and end (``time.monotonic``), and, after each, the files of
    ``out/checkpoints`` and the folder ``latest`` picks there at that instant."""
    import pathlib

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from distlab.checkpoint import Checkpoints, latest
    from distlab.checkpoint import checkpoints as protocol
    from distlab.checkpoint.checkpoints import CheckpointConfig
    from distlab.model import GPT, preset
    from distlab.parallel import apply_ddp

    cfg = CheckpointConfig(out=out, steps=40, checkpoint_every=10)
    model = apply_ddp(GPT(preset(cfg.preset)), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's state exists after a first step
    checkpoints = Checkpoints(cfg, model, optimizer)
    for step in steps[:-1]:
        checkpoints.save(step)
    folder, events = Path(out) / "checkpoints", []

    def listing() -> list[str]:
        return sorted(
            f"{p.relative_to(folder)}" + ("/" if p.is_dir() else "")
            for p in folder.rglob("*")
        )

    def stamped(name, fn):
        def wrapper(*args, **kwargs):
            start = time.monotonic()
            if name == ".partial made" and args[0].exists():
                return fn(*args, **kwargs)  # DCP's own mkdir(exist_ok=True)
            if name == "renamed" and str(args[1]).endswith(".metadata"):
                return fn(*args, **kwargs)  # inside DCP's finish: .metadata.tmp
            result = fn(*args, **kwargs)
            found = latest(folder)
            events.append(
                {
                    "name": name,
                    "start": start,
                    "end": time.monotonic(),
                    "files": listing(),
                    "latest": found.name if found else None,
                }
            )
            return result

        return wrapper

    patches = [
        (pathlib.Path, "mkdir", ".partial made"),
        (dist, "barrier", "barrier"),
        (FileSystemWriter, "write_data", "shard written"),
        (FileSystemWriter, "finish", ".metadata written"),
        (protocol, "write_durably", "train_state.json"),
        (pathlib.Path, "rename", "renamed"),
    ]
    originals = [
        (owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in patches
    ]
    for owner, attribute, name in patches:
        setattr(owner, attribute, stamped(name, getattr(owner, attribute)))
    try:
        checkpoints.save(steps[-1])
    finally:  # the process goes on to other experiments
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)
    return events


def save_then_preempt(out: str) -> tuple[list[dict], dict]:
    """The page's two experiments on ranks, in one launch (torch imported once): one
    save, step by step (``save_events``), then a preemption of rank 1
    (``preemption_events``)."""
    from distlab.figures.preemption_timeline import preemption_events

    return save_events(out), preemption_events(out + "_preempt")


def store_probe(work: Path) -> tuple[int, list[str]]:
    """Run ``src/examples/store_probe.py`` under ``torchrun --max-restarts=1`` (workers
    forked, as ``torchrun_killing_a_rank`` has them); returns torchrun's exit code and
    the probe's ``attempt ...`` lines, sorted, then its stderr's tail on failure."""
    from distlab.infra.paths import REPO_ROOT

    out, err = work / "probe.out", work / "probe.err"
    out.touch(), err.touch()
    probe = start_node(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--monitor-interval=0.1",
            "--start-method=fork",
            "--run-path",
            str(REPO_ROOT / "src" / "examples" / "store_probe.py"),
        ],
        out,
        err,
        env=dict(os.environ),
        cwd=REPO_ROOT,
    )
    probe.wait()
    found = probe_reports(out.read_text())
    if probe.returncode != 0:
        found.append(err.read_text()[-2000:])
    return probe.returncode, found


def probe_reports(text: str) -> list[str]:
    """The ``attempt N, rank R: ...`` reports in the probe's output, sorted; two ranks
    may write into one line of the shared output, so each report is cut at the next."""
    return sorted(
        re.findall(r"attempt \d+, rank \d+: .*?(?=attempt \d+, rank|$)", text, re.M)
    )
