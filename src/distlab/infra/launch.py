"""Run a function or a lab script on N local ranks from a notebook, safely.

    results = run_ranks(fn, nprocs=2)            # fn(*args) on every rank, results by rank
    run_script("src/labs/lab1_single.py", ["--steps", "50"], nprocs=1)

Underneath is PyTorch's own elastic launcher (what ``torchrun`` uses), with a c10d
rendezvous on 127.0.0.1 and an OS-chosen free port, so two launches at once never
collide. The launcher runs in a child process of its own session (forked from a forkserver
that imported torch once, so a launch does not pay for that import), which buys two things
a notebook needs: a wall-clock ``timeout`` that kills every rank (a hung collective or an
endless loop cannot hang the notebook), and functions defined in the notebook itself
(they travel by value with cloudpickle). A rank that fails raises ``RankFailed`` here,
naming the rank and carrying its error.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from distlab.infra.paths import REPO_ROOT


class RankFailed(RuntimeError):
    """A rank raised or exited non-zero; ``rank`` and ``details`` say which and why."""

    def __init__(self, rank: int, summary: str, details: str = ""):
        super().__init__(f"rank {rank} failed: {summary}" + (f"\n{details}" if details else ""))
        self.rank, self.summary, self.details = rank, summary, details


class LaunchTimeout(TimeoutError):
    """The ranks did not finish in time; every rank has been killed."""


class PortInUse(OSError):
    """The rendezvous port asked for is taken; nothing was started."""


def free_port() -> int:
    """A port on 127.0.0.1 that is free now. Another program could take it before it is
    bound; ``check_port_free`` just before starting says so instead of waiting forever."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    # torchrun's c10d rendezvous on a port some other program listens on waits forever
    # (measured with torch 2.13), so refuse up front with the cause
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise PortInUse(
                f"port {port} on 127.0.0.1 is already in use; pick another or omit it to let the OS choose a free one"
            ) from None


# ---------------------------------------------------------------- inside each rank
def _rank_entry(fn_bytes: bytes, args: tuple, device_request: str, pg_timeout_s: float, init_group: bool) -> Any:
    """What every rank runs: join the process group, call the function, leave."""
    import torch.distributed as dist

    from distlab.runtime import dist_env, init_distributed, pick_device

    fn = cloudpickle.loads(fn_bytes)
    if not init_group:
        return fn(*args)
    init_distributed(pick_device(device_request, dist_env()[1]), timeout_s=pg_timeout_s)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher child
def _script_entry(path: str, argv: tuple) -> None:
    """What every rank runs for ``run_script``: the script as ``python path *argv`` would run it.

    The rank is forked from the launcher, which has imported torch already, so the script
    starts without paying for that import again on every rank (seconds per launch on a
    small CPU). Its exit status and stderr reach ``_failure_report`` as a process's would.
    """
    import runpy

    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))  # as `python path` puts the script's folder first
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:  # sys.exit("message"): print it while stderr still goes to the rank's log
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        raise


# a stderr line that names the cause of a failure
_NAMES_AN_ERROR = re.compile(r"Error\b|error:|Exception\b|what\(\)|Timed out|doesn't match")


def _failure_report(err, log_dir: str) -> tuple[int, str, str]:
    """(rank, one-line summary, details) of the rank that failed first: the root cause."""
    rank, failure = err.get_first_failure()
    message = (failure.error_file_data or {}).get("message", "")
    summary, details = "", ""
    if isinstance(message, dict):  # a function rank: elastic recorded its exception
        # "ExcType: first line of its message" names the cause; the rest is in details
        summary = next(iter(message.get("message", "").strip().splitlines()), "")
        details = message.get("extraInfo", {}).get("py_callstack", "")
    if not summary:  # a script that exited non-zero, or a signal: its stderr says why
        code = failure.exitcode
        summary = f"exit code {code}"
        if code < 0 and -code in signal.valid_signals():  # -9: SIGKILL (the OOM killer, kill -9)
            summary += f" ({signal.Signals(-code).name})"
        # one node, so the global rank is the local rank that names the log folder
        logs = sorted(Path(log_dir).glob(f"*/attempt_*/{rank}/stderr.log"))
        if logs:
            lines = [ln for ln in logs[-1].read_text(errors="replace").splitlines() if ln.strip()]
            # the last line that names an error; after a C++ abort, Python's fatal-error dump
            # (thread stacks, "Extension modules: ...") comes after it
            cause = next((ln for ln in reversed(lines) if _NAMES_AN_ERROR.search(ln)), None)
            if code > 0 and lines:
                summary = cause or lines[-1]
            elif cause:
                summary += f": {cause.strip()}"
            details = "\n".join(lines[-40:])
    return rank, summary, details


def _launcher_main(spec_path: str) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    spec = pickle.loads(Path(spec_path).read_bytes())
    log_dir = tempfile.mkdtemp(prefix="distlab-logs-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=spec["nprocs"],
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{spec['port']}",  # 0: the OS picks a free one
        rdzv_configs={"timeout": 60},
        max_restarts=0,
        monitor_interval=0.1,
        # fork, not spawn: a function's ranks start from this process, torch already imported
        # (measured ~40% faster per launch); it has touched no GPU, so forking is safe
        start_method="fork",
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        log_line_prefix_template="[rank${rank}] ",
    )
    try:
        results = elastic_launch(config, spec["entrypoint"])(*spec["args"])
        outcome = {"results": [results[r] for r in sorted(results)]}
    except ChildFailedError as err:
        outcome = {"failure": _failure_report(err, log_dir)}
    finally:  # the ranks' output has been teed to our log already; these copies are not needed
        shutil.rmtree(log_dir, ignore_errors=True)
    Path(spec["result_path"]).write_bytes(pickle.dumps(outcome))


# ---------------------------------------------------------------- in the notebook
# The launcher process is forked from a forkserver that imported torch once, instead of
# starting a fresh interpreter per launch: importing torch is the largest fixed cost of a
# launch on a small CPU (about 2 s of its 4), and a notebook or the tests launch dozens of times.
# torch._dynamo too: a rank's first optimizer step, and elastic's logging of a failure, import
# it (about 1.4 s each time); imported here once, a 2-step lab 2 run went from 2.3 to 1.0 s
# and a failing launch from 2.5 to 0.6 s
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.launcher.api",
    "cloudpickle",
]


def _context():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _launcher_child(spec_path: str, log_path: str, env: dict[str, str]) -> None:
    """The launcher process: its own session (so a timeout's killpg reaches every rank), the
    caller's environment of now, and its output (and the ranks') into ``log_path``."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(log, fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)
    import torch

    if "OMP_NUM_THREADS" in env:  # torch was imported before this variable was set: apply it
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    _launcher_main(spec_path)


def _rank_env(nprocs: int, device: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device in ("auto", "cpu") and "OMP_NUM_THREADS" not in os.environ:
        # ranks that share the cores must not each start a thread per core (3x slower)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))
    # the ranks import what the caller can import: a function from a module on the
    # caller's path (a test file, say) is pickled by reference and must resolve there too
    caller_path = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), *caller_path])
    return env


# gloo's full-mesh connect, the first thing every rank does, now and then fails when other
# launches run at the same time on a busy machine ("Gloo connectFullMesh failed ...
# Connection closed by peer": measured 1 in 25 two-rank launches next to two other
# launchers on 2 cores, and in one CI run of the tests on two workers). The cause is inside
# gloo's connection set-up; no rank has run the caller's code yet, so the launch is repeated.
_CONNECT_FAILED = "Gloo connectFullMesh failed"
_LAUNCH_ATTEMPTS = 3


def _launch(entrypoint, args: tuple, nprocs: int, timeout: float, device: str, quiet: bool, port: int = 0) -> list:
    for attempt in range(1, _LAUNCH_ATTEMPTS + 1):
        try:
            return _launch_once(entrypoint, args, nprocs, timeout, device, quiet, port)
        except RankFailed as failure:
            if _CONNECT_FAILED not in str(failure) or attempt == _LAUNCH_ATTEMPTS:
                raise
            print(
                f"distlab.infra.launch: gloo could not connect the ranks ({failure.summary[:90]}...); "
                f"launching again ({attempt + 1} of {_LAUNCH_ATTEMPTS})",
                file=sys.stderr,
                flush=True,
            )


def _launch_once(entrypoint, args: tuple, nprocs: int, timeout: float, device: str, quiet: bool, port: int = 0) -> list:
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    if port:
        check_port_free(port)
    with tempfile.TemporaryDirectory(prefix="distlab-launch-") as tmp:
        spec_path, result_path = Path(tmp, "spec.pkl"), Path(tmp, "result.pkl")
        spec_path.write_bytes(
            pickle.dumps(
                {
                    "entrypoint": entrypoint,
                    "args": args,
                    "nprocs": nprocs,
                    "result_path": str(result_path),
                    "port": port,
                }
            )
        )
        log_path = Path(tmp, "output.log")
        log_path.touch()
        proc = _context().Process(
            target=_launcher_child, args=(str(spec_path), str(log_path), _rank_env(nprocs, device))
        )
        proc.start()
        output: list[str] = []
        muted = threading.Event()  # set once we kill the ranks: their dying words are noise
        done = threading.Event()
        reader = threading.Thread(target=_pump, args=(log_path, done, output, quiet, muted), daemon=True)
        reader.start()
        proc.join(timeout)
        if proc.exitcode is None:
            muted.set()
            _kill_session(proc)
            done.set()
            reader.join(5)
            raise LaunchTimeout(f"{nprocs} rank(s) did not finish within {timeout:.0f} s; all were killed")
        done.set()
        reader.join(5)
        if not result_path.exists():
            tail = "".join(output[-20:])
            raise RankFailed(-1, f"the launcher exited with code {proc.exitcode} before any result", tail)
        outcome = pickle.loads(result_path.read_bytes())
    if "failure" in outcome:
        raise RankFailed(*outcome["failure"])
    return outcome["results"]


def _pump(path: Path, done: threading.Event, output: list[str], quiet: bool, muted: threading.Event) -> None:
    """Follow the launcher's output file line by line until ``done`` and nothing is left."""
    with open(path, errors="replace") as stream:
        pending = ""
        while True:
            chunk = stream.read()
            if not chunk:
                if done.is_set():
                    break
                time.sleep(0.05)
                continue
            *lines, pending = (pending + chunk).split("\n")
            for line in lines:
                line += "\n"
                output.append(line)
                if not (quiet or muted.is_set() or _AGENT_LOG.match(line)):
                    print(line, end="", flush=True)
        if pending:
            output.append(pending)


# the elastic agent's own log lines ("E1121 10:00:08.758000 2413 torch/...") repeat what
# RankFailed already says; the ranks' lines carry a "[rankN] " prefix and are kept
_AGENT_LOG = re.compile(r"[EWI]\d{4} \d\d:\d\d:\d\d")


def _kill_session(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        proc.join(wait)
        if proc.exitcode is not None:
            time.sleep(0.2)  # let the ranks, not only the launcher, go
            break
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the same session
    except ProcessLookupError:
        pass


def run_ranks(
    fn: Callable,
    nprocs: int = 2,
    args: tuple = (),
    timeout: float = 120,
    device: str = "auto",
    pg_timeout: float = 60,
    init_group: bool = True,
    quiet: bool = False,
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` ranks; returns ``[result of rank 0, rank 1, ...]``.

    Each rank has joined the default process group (gloo on CPU, NCCL on GPU, with a
    ``pg_timeout`` second timeout) before ``fn`` runs, so ``fn`` can use
    ``torch.distributed`` directly. Results must be picklable.
    """
    payload = (cloudpickle.dumps(fn), tuple(args), device, pg_timeout, init_group)
    return _launch(_rank_entry, payload, nprocs, timeout, device, quiet)


def run_script(
    script: str | os.PathLike,
    args: list[str] = (),
    nprocs: int = 1,
    timeout: float = 600,
    device: str = "auto",
    quiet: bool = False,
    port: int = 0,
) -> None:
    """Run ``python script *args`` on ``nprocs`` ranks, as ``torchrun`` would.

    A relative ``script`` is looked up from the repository root, so notebooks anywhere
    can say ``run_script("src/labs/lab1_single.py", ...)``. ``port`` 0 lets the OS pick a
    free rendezvous port; a port that is taken raises ``PortInUse`` before anything starts.
    """
    path = Path(script)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"no script at {path}")
    _launch(_script_entry, (str(path), tuple(map(str, args))), nprocs, timeout, device, quiet, port)
