"""The machinery under ``distlab.infra.launch``: the launcher process, what each rank
runs, the launcher's output followed line by line, and the report of a failed rank.

    # a forkserver child in a session of its own
    proc = start_launcher(spec_path, log_path, env)
    # its output (and the ranks'), as it comes
    pump(log_path, done, output, quiet, muted)
    # on a timeout: the launcher and every rank
    kill_session(proc)

The launcher runs PyTorch's elastic launcher (what ``torchrun`` uses) on the spec that
``distlab.infra.launch`` pickled, and writes the ranks' results, or the failure that
caused the others, back to a file.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import cloudpickle


# ---------------------------------------------------------------- inside each rank
def rank_entry(
    fn_bytes: bytes,
    args: tuple,
    device_request: str,
    pg_timeout_s: float,
    init_group: bool,
) -> Any:
    """What every rank runs for ``run_ranks``: join the process group, call the
    function, leave."""
    import torch.distributed as dist

    from distlab.runtime import dist_env, init_distributed, pick_device

    fn = cloudpickle.loads(fn_bytes)
    if not init_group:
        return fn(*args)
    init_distributed(pick_device(device_request, dist_env()[1]), timeout_s=pg_timeout_s)
    try:
        return fn(*args)
    except Exception as err:
        if any(text in str(err) for text in _PEER_GONE):
            # the peer whose socket closed is still dying: let its own failure be
            # recorded first, or elastic records only this one (_root_failure)
            time.sleep(PEER_GONE_GRACE_S)
        raise
    finally:
        dist.destroy_process_group()


def script_entry(path: str, argv: tuple) -> None:
    """What every rank runs for ``run_script``: the script as ``python path *argv``
    would run it.

    The rank is forked from the launcher, which has imported torch already, so the
    script starts without paying for that import again on every rank (seconds per launch
    on a small CPU). Its exit status and stderr reach ``_failure_report`` as a
    process's would.
    """
    import runpy

    sys.argv = [path, *argv]
    # as `python path` puts the script's folder first
    sys.path.insert(0, str(Path(path).parent))
    try:
        runpy.run_path(path, run_name="__main__")
    # sys.exit("message"): print it while stderr still goes to the rank's log
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        raise


# ---------------------------------------------------------------- the launcher child
# a stderr line that names the cause of a failure
_NAMES_AN_ERROR = re.compile(
    r"Error\b|error:|Exception\b|what\(\)|Timed out|doesn't match"
)


# A rank whose peer died fails a moment later with the peer's socket closed. Elastic's
# get_first_failure picks the smallest timestamp, but its timestamps are whole seconds,
# so the two often tie and the lower rank wins: a send-first ring on 2 ranks, where rank
# 1 timed out, was once reported as rank 0's "Connection closed by peer" (a CI run of
# the tests).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
# ...and a tie is not the only way: when the rank that timed out is still exiting (its
# error file, its destructors) as its peer fails on the closed socket, elastic's agent
# sees only the peer's failure and SIGTERMs the first rank before recording it (a
# send-first ring on 2 ranks under load: 1 launch in 12). A rank that lost its peer
# therefore waits this long before it fails.
PEER_GONE_GRACE_S = 2.0


def _root_failure(err) -> tuple[int, Any]:
    """The failure that caused the others: a rank's own error before a lost peer, then
    the earliest."""

    def order(item):
        rank, failure = item
        lost_peer = any(text in str(failure.message) for text in _PEER_GONE)
        return (lost_peer, failure.timestamp, rank)

    return min(err.failures.items(), key=order)


def _failure_report(err, log_dir: str) -> tuple[int, str, str]:
    """(rank, one-line summary, details) of the rank whose failure is the root cause."""
    rank, failure = _root_failure(err)
    message = (failure.error_file_data or {}).get("message", "")
    summary, details = "", ""
    if isinstance(message, dict):  # a function rank: elastic recorded its exception
        # "ExcType: first line of its message" names the cause; the rest is in details
        summary = next(iter(message.get("message", "").strip().splitlines()), "")
        details = message.get("extraInfo", {}).get("py_callstack", "")
    if not summary:  # a script that exited non-zero, or a signal: its stderr says why
        code = failure.exitcode
        summary = f"exit code {code}"
        # -9: SIGKILL (the OOM killer, kill -9)
        if code < 0 and -code in signal.valid_signals():
            summary += f" ({signal.Signals(-code).name})"
        # one node, so the global rank is the local rank that names the log folder
        logs = sorted(Path(log_dir).glob(f"*/attempt_*/{rank}/stderr.log"))
        if logs:
            lines = [
                ln
                for ln in logs[-1].read_text(errors="replace").splitlines()
                if ln.strip()
            ]
            # the last line that names an error; after a C++ abort, Python's fatal-error
            # dump (thread stacks, "Extension modules: ...") comes after it
            cause = next(
                (ln for ln in reversed(lines) if _NAMES_AN_ERROR.search(ln)), None
            )
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
        # Where no GPU is visible, the ranks are forked: they start from this process,
        # torch already imported (measured ~40% faster per launch). Where one is, they
        # are spawned, fresh interpreters: CUDA cannot be used in a child forked from a
        # process that initialised it, and on an H100 (torch 2.11) every forked GPU rank
        # failed so ("Cannot re-initialize CUDA in forked subprocess"; their ancestor is
        # the forkserver, which preloads torch and torch._dynamo), and forked CPU ranks
        # aborted in backward
        start_method=spec.get("start_method", "fork"),
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        log_line_prefix_template="[rank${rank}] ",
    )
    try:
        results = elastic_launch(config, spec["entrypoint"])(*spec["args"])
        outcome = {"results": [results[r] for r in sorted(results)]}
    except ChildFailedError as err:
        outcome = {"failure": _failure_report(err, log_dir)}
    # the ranks' output has been teed to our log already; these copies are not needed
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    Path(spec["result_path"]).write_bytes(pickle.dumps(outcome))


def _launcher_child(spec_path: str, log_path: str, env: dict[str, str]) -> None:
    """The launcher process: its own session (so a timeout's killpg reaches every rank),
    the caller's environment of now, and its output (and the ranks') into ``log_path``.
    """
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(log, fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)
    import torch

    # torch was imported before this variable was set: apply it
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    _launcher_main(spec_path)


# ---------------------------------------------------------------- in the notebook
# The launcher process is forked from a forkserver that imported torch once, instead of
# starting a fresh interpreter per launch: importing torch is the largest fixed cost of
# a launch on a small CPU (about 2 s of its 4), and a notebook or the tests launch
# dozens of times. torch._dynamo too: a rank's first optimizer step, and elastic's
# logging of a failure, import it (about 1.4 s each time); imported here once, a 2-step
# lab 2 run went from 2.3 to 1.0 s and a failing launch from 2.5 to 0.6 s
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


def start_launcher(spec_path: str, log_path: str, env: dict[str, str]):
    """Start the launcher process on the pickled spec at ``spec_path``; returns
    it, started."""
    proc = _context().Process(target=_launcher_child, args=(spec_path, log_path, env))
    proc.start()
    return proc


def pump(
    path: Path,
    done: threading.Event,
    output: list[str],
    quiet: bool,
    muted: threading.Event,
) -> None:
    """Follow the launcher's output file line by line until ``done`` and nothing
    is left."""
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
                if not (
                    quiet
                    or muted.is_set()
                    or _AGENT_LOG.match(line)
                    or CONNECT_FAILED in line
                ):
                    print(line, end="", flush=True)
        if pending:
            output.append(pending)


# gloo's full-mesh connect failing at start: ``distlab.infra.launch`` launches again,
# and if every attempt fails, its RankFailed carries the message; not echoed live
CONNECT_FAILED = "Gloo connectFullMesh failed"
# the elastic agent's own log lines ("E1121 10:00:08.758000 2413 torch/...") repeat what
# RankFailed already says; the ranks' lines carry a "[rankN] " prefix and are kept
_AGENT_LOG = re.compile(r"[EWI]\d{4} \d\d:\d\d:\d\d")


def kill_session(proc) -> None:
    """SIGTERM, then SIGKILL, to the launcher's session: the launcher and every rank
    it started."""
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
