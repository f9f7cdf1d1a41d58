"""Run a function or a lab script on N local ranks from a notebook, safely.

    results = run_ranks(fn, nprocs=2)  # fn(*args) on every rank, results by rank
    run_script("src/labs/lab1_single.py", ["--steps", "50"], nprocs=1)

The ranks run on the CPU over gloo, on a machine with GPUs too, unless ``device="cuda"``
asks for one GPU per rank: what the book shows does not depend on the machine that
builds it.

Underneath is PyTorch's own elastic launcher (what ``torchrun`` uses), with a c10d
rendezvous on 127.0.0.1 and an OS-chosen free port, so two launches at once never
collide. The launcher runs in a child process of its own session (forked from a
forkserver that imported torch once, so a launch does not pay for that import), which
buys two things a notebook needs: a wall-clock ``timeout`` that kills every rank (a hung
collective or an endless loop cannot hang the notebook), and functions defined in the
notebook itself (they travel by value with cloudpickle). A rank that fails raises
``RankFailed`` here, naming the rank and carrying its error. The launcher itself is in
``distlab.infra.launcher``; the ports in ``distlab.infra.ports``.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import torch

from distlab.errors import UserError
from distlab.infra.launcher import (
    CONNECT_FAILED,
    kill_session,
    pump,
    rank_entry,
    script_entry,
    start_launcher,
)
from distlab.infra.paths import REPO_ROOT
from distlab.infra.ports import check_port_free
from distlab.runtime import CPU_PIN, cpu_pinned


class RankFailed(RuntimeError):
    """A rank raised or exited non-zero; ``rank`` and ``details`` say which and why."""

    def __init__(self, rank: int, summary: str, details: str = ""):
        super().__init__(
            f"rank {rank} failed: {summary}" + (f"\n{details}" if details else "")
        )
        self.rank, self.summary, self.details = rank, summary, details


class LaunchTimeout(TimeoutError):
    """The ranks did not finish in time; every rank has been killed."""


def _rank_env(nprocs: int, device: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        # pinned: every rank's "auto" is the CPU and no rank sees a GPU, so the book and
        # the CPU tests run on gloo CPU ranks, with the same results, on a machine with
        # GPUs too
        env.update({CPU_PIN: "cpu", "CUDA_VISIBLE_DEVICES": ""})
    elif device == "cuda":
        # asked for GPUs: a pin in the caller's environment must not undo it
        env.pop(CPU_PIN, None)
    if _ranks_use_cpu(device) and "OMP_NUM_THREADS" not in os.environ:
        # ranks that share the cores must not each start a thread per core (3x slower)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))
    # the ranks import what the caller can import: a function from a module on the
    # caller's path (a test file, say) is pickled by reference and must resolve
    # there too
    caller_path = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), *caller_path])
    return env


def _ranks_use_cpu(device: str) -> bool:
    """Whether the ranks' ``pick_device(device)`` will choose the CPU (else one
    GPU each)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return device == "cpu" or (
        device == "auto" and (cpu_pinned() or not torch.cuda.is_available())
    )


def _check_gpus_for(nprocs: int, device: str) -> None:
    """One GPU per rank: more ranks than GPUs fails here in one line, before anything
    starts, not in every extra rank as "invalid device ordinal"."""
    if _ranks_use_cpu(device):
        return
    gpus = torch.cuda.device_count()
    if nprocs > gpus:
        raise UserError(
            f"{nprocs} ranks on device={device!r} need {nprocs} GPUs, one per "
            "rank, and this process sees "
            f"{gpus}: start at most {gpus} rank{'s' if gpus != 1 else ''}, or "
            "pass device='cpu'"
        )


# gloo's full-mesh connect, the first thing every rank does, now and then fails when
# other launches run at the same time on a busy machine ("Gloo connectFullMesh failed
# ... Connection closed by peer": measured 1 in 25 two-rank launches next to two other
# launchers on 2 cores, and in one CI run of the tests on two workers). The cause is
# inside gloo's connection set-up; no rank has run the caller's code yet, so the launch
# is repeated.
_LAUNCH_ATTEMPTS = 3


def _launch(
    entrypoint,
    args: tuple,
    nprocs: int,
    timeout: float,
    device: str,
    quiet: bool,
    port: int = 0,
) -> list:
    for attempt in range(1, _LAUNCH_ATTEMPTS + 1):
        try:
            return _launch_once(entrypoint, args, nprocs, timeout, device, quiet, port)
        except RankFailed as failure:
            if CONNECT_FAILED not in str(failure) or attempt == _LAUNCH_ATTEMPTS:
                raise
            # one short line: it can land in a page's output (within 88 columns)
            print(
                "distlab.infra.launch: gloo could not connect the ranks; "
                f"launching again ({attempt + 1} of {_LAUNCH_ATTEMPTS})",
                file=sys.stderr,
                flush=True,
            )


def _launch_once(
    entrypoint,
    args: tuple,
    nprocs: int,
    timeout: float,
    device: str,
    quiet: bool,
    port: int = 0,
) -> list:
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    _check_gpus_for(nprocs, device)
    if port:
        check_port_free(port)
    with tempfile.TemporaryDirectory(prefix="distlab-launch-") as tmp:
        spec_path, result_path = Path(tmp, "spec.pkl"), Path(tmp, "result.pkl")
        spec = {
            "entrypoint": entrypoint,
            "args": args,
            "nprocs": nprocs,
            "result_path": str(result_path),
            "port": port,
        }
        # fork only where no process of ours can have touched a GPU (why:
        # launcher.py, LaunchConfig)
        spec["start_method"] = "spawn" if torch.cuda.is_available() else "fork"
        spec_path.write_bytes(pickle.dumps(spec))
        log_path = Path(tmp, "output.log")
        log_path.touch()
        proc = start_launcher(str(spec_path), str(log_path), _rank_env(nprocs, device))
        output: list[str] = []
        # set once we kill the ranks: their dying words are noise
        muted = threading.Event()
        done = threading.Event()
        reader = threading.Thread(
            target=pump, args=(log_path, done, output, quiet, muted), daemon=True
        )
        reader.start()
        proc.join(timeout)
        if proc.exitcode is None:
            muted.set()
            kill_session(proc)
            done.set()
            reader.join(5)
            raise LaunchTimeout(
                f"{nprocs} rank(s) did not finish within {timeout:.0f} s; all "
                "were killed"
            )
        done.set()
        reader.join(5)
        if not result_path.exists():
            tail = "".join(output[-20:])
            raise RankFailed(
                -1,
                f"the launcher exited with code {proc.exitcode} before any result",
                tail,
            )
        outcome = pickle.loads(result_path.read_bytes())
    if "failure" in outcome:
        raise RankFailed(*outcome["failure"])
    return outcome["results"]


def run_ranks(
    fn: Callable,
    nprocs: int = 2,
    args: tuple = (),
    timeout: float = 120,
    device: str = "cpu",
    pg_timeout: float = 60,
    init_group: bool = True,
    quiet: bool = False,
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` ranks; returns ``[result of rank 0, rank 1,
    ...]``.

    Each rank has joined the default process group (gloo on CPU, NCCL on GPU, with a
    ``pg_timeout`` second timeout) before ``fn`` runs, so ``fn`` can use
    ``torch.distributed`` directly. Results must be picklable.

    ``device="cpu"`` (the default) pins the ranks to the CPU and gloo even where there
    are GPUs (``DISTLAB_DEVICE=cpu`` and an empty ``CUDA_VISIBLE_DEVICES`` in their
    environment); ``"cuda"`` gives each rank a GPU of its own (at most one rank per
    GPU), and ``"auto"`` lets the ranks choose as ``distlab.runtime.pick_device`` does.
    """
    payload = (cloudpickle.dumps(fn), tuple(args), device, pg_timeout, init_group)
    return _launch(rank_entry, payload, nprocs, timeout, device, quiet)


def run_script(
    script: str | os.PathLike,
    args: list[str] = (),
    nprocs: int = 1,
    timeout: float = 600,
    device: str = "cpu",
    quiet: bool = False,
    port: int = 0,
) -> None:
    """Run ``python script *args`` on ``nprocs`` ranks, as ``torchrun`` would.

    A relative ``script`` is looked up from the repository root, so notebooks anywhere
    can say ``run_script("src/labs/lab1_single.py", ...)``. ``device`` is the ranks'
    environment, as for ``run_ranks``: with ``"cpu"`` (the default) the script's
    ``--device auto`` is the CPU whatever GPUs the machine has; pass ``"cuda"`` with
    ``--device cuda``. ``port`` 0 lets the OS pick a free rendezvous port; a port that
    is taken raises ``distlab.infra.ports.PortInUse`` before anything starts.
    """
    path = Path(script)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"no script at {path}")
    _launch(
        script_entry,
        (str(path), tuple(map(str, args))),
        nprocs,
        timeout,
        device,
        quiet,
        port,
    )
