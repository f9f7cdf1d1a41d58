"""Start a ``torchrun`` command without importing torch again: the nodes of the
multi-node page, the restarts of the fault-tolerance page.

    proc = start_node(
        [*TORCHRUN, "--nnodes=2", ..., "-m", "pkg"], out_path, err_path, env, cwd
    )
    proc.pid, proc.poll(), proc.wait(), proc.returncode   # as subprocess.Popen's

``python -m torch.distributed.run`` spends about 2 CPU-seconds importing torch before it
does anything; a page that starts seven "nodes" on a 2-core machine pays that seven
times. Here every torchrun node is forked from the forkserver that
``distlab.infra.launch`` starts its launchers from (it has imported torch and torch's
elastic launcher once), and runs ``torch.distributed.run`` as ``python -m`` runs it,
with the command's arguments: the same code, in a process and a session of its own (so
that ``kill_tree`` reaches it and its workers), with the given environment, folder,
stdout and stderr. The workers that torchrun starts are fresh interpreters, as always.
What torch reads from the environment when it is imported is the forkserver's, this
process's when the forkserver started. Any other command is started with
``subprocess.Popen``.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

# torchrun as the user types it, with this Python (so the subprocess sees the
# same torch)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class ForkedNode:
    """A forked torchrun, with the part of ``subprocess.Popen``'s interface that
    callers use."""

    def __init__(self, process):
        self._process, self.pid = process, process.pid

    @property
    # negative: ended by that signal, as for a Popen
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self) -> int:
        self._process.join()
        return self._process.exitcode


def _torchrun_child(
    args: list[str], out: str, err: str, env: dict[str, str], cwd: str
) -> None:
    """In the forked child: become the process ``torchrun *args`` would be, and run it.
    An error ends it as it ends python: the traceback on stderr (multiprocessing prints
    it), status 1."""
    os.setsid()  # a session of its own, as start_new_session=True gives a Popen
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    for stream in (sys.stdout, sys.stderr):
        # as PYTHONUNBUFFERED: nothing lost to a kill
        stream.reconfigure(write_through=True)
    os.environ.clear()
    os.environ.update(env)
    # torch was imported before this variable was set: apply it
    if "OMP_NUM_THREADS" in env:
        # (to this torchrun, and to the workers it forks with --start-method=fork)
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    # torchrun's log folder: under this node's TMPDIR, read again
    tempfile.tempdir = None
    sys.argv = ["torchrun", *args]
    # if the forkserver imported it: run it afresh
    sys.modules.pop("torch.distributed.run", None)
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


def start_node(
    command: list[str], out: Path, err: Path, env: dict, cwd: str | os.PathLike
):
    """Start ``command`` with its output appended to the files ``out`` and ``err``
    (which exist)."""
    if command[: len(TORCHRUN)] != TORCHRUN:
        with open(out, "a") as stdout, open(err, "a") as stderr:
            return subprocess.Popen(
                command,
                stdout=stdout,
                stderr=stderr,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
    # the launchers' forkserver: one torch import for both
    from distlab.infra.launcher import _context

    args = (command[len(TORCHRUN) :], str(out), str(err), dict(env), str(cwd))
    process = _context().Process(target=_torchrun_child, args=args)
    process.start()
    return ForkedNode(process)
