"""Starting the ranks: one script launched by ``mp.spawn`` and by ``torchrun``, and
what each rank received from its launcher.

Used by the chapter "Starting the ranks" and checked by its tests:

* ``launch_both`` runs ``src/examples/spawn_example.py`` both ways at once, each in a
  subprocess with a deadline, and reads what every rank wrote about itself
  (``--report``: its pid and its parent's, the environment it started with, its
  losses) after all have exited.
* ``received`` is a rank's environment minus its launcher's: what the launcher set.
* ``launch_figure`` draws the processes and what each rank received.
* ``try_spawn`` is ``mp.spawn`` with a deadline that reports a failure in one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch.multiprocessing as mp

from distlab.infra.paths import REPO_ROOT

SCRIPT = "src/examples/spawn_example.py"
# what a rank needs to know, in the order the page lists them; torchrun sets the rest
# too (GROUP_*, ROLE_*, TORCHELASTIC_*: see the installed local_elastic_agent.py)
KEY_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


@dataclass
class Launch:
    """One launch of the example: the command, the launcher's pid, and each rank's
    report (``rank{r}.json``), read after the launcher exited."""

    name: str
    command: list[str]
    env: dict[str, str]  # the launcher's own environment
    pid: int = 0
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    reports: list[dict] = field(default_factory=list)

    def shown(self) -> str:
        """The command as a reader types it."""
        words = ["python" if w == sys.executable else w for w in self.command]
        text = " ".join(w for w in words if not w.startswith("--report"))
        return text.replace("python -m torch.distributed.run", "torchrun")


def commands(steps: int, nprocs: int = 2, device: str = "cpu") -> dict[str, list]:
    """The same script, launched by mp.spawn (the script calls it) and by torchrun."""
    flags = ["--steps", str(steps), "--device", device]
    return {
        "mp.spawn": [sys.executable, SCRIPT, "--nprocs", str(nprocs), *flags],
        # torchrun is python -m torch.distributed.run
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nprocs}",
            SCRIPT,
            *flags,
        ],
    }


def _run(launch: Launch, folder: Path, timeout: float) -> Launch:
    command = [*launch.command, "--report", str(folder)]
    proc = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=launch.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killed whole on a timeout
    )
    launch.pid = proc.pid
    try:
        launch.stdout, launch.stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        launch.stdout, launch.stderr = proc.communicate()
    launch.returncode = proc.returncode
    # each rank's own file, read after every rank has exited
    launch.reports = [
        json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))
    ]
    return launch


def launch_both(steps: int = 3, nprocs: int = 2, timeout: float = 180) -> dict:
    """Both launches at once (they share no port: the spawn script picks a free one,
    torchrun --standalone binds its own). The launchers' environment has no
    ``OMP_NUM_THREADS``, as in a fresh shell, so that what torchrun sets shows."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    with tempfile.TemporaryDirectory() as tmp:
        launches, folders = [], []
        for name, command in commands(steps, nprocs).items():
            folders.append(Path(tmp, name.replace(".", "_")))
            folders[-1].mkdir()
            launches.append(Launch(name, command, env))
        with ThreadPoolExecutor(len(launches)) as pool:
            done = list(pool.map(_run, launches, folders, [timeout] * len(launches)))
    for launch in done:
        if launch.returncode != 0 or len(launch.reports) != nprocs:
            raise RuntimeError(
                f"{launch.shown()} exited with {launch.returncode}:\n"
                f"{launch.stderr[-3000:]}"
            )
    return {launch.name: launch for launch in done}


def received(report: dict, launcher_env: dict) -> dict[str, str]:
    """The variables a rank has that its launcher did not have, or had otherwise."""
    return {k: v for k, v in sorted(report["env"].items()) if launcher_env.get(k) != v}


def short(value: str, width: int = 14) -> str:
    """A value cut to ``width`` characters (a run id, a file path)."""
    return value if len(value) <= width else value[: width - 1] + "…"


def launch_figure(launches: dict):
    """Each launcher, its ranks (pids, and the pid of the process that started them),
    and the key variables each rank received: a grid, one column per rank."""
    import matplotlib.pyplot as plt

    columns = [(name, r) for name, launch in launches.items() for r in launch.reports]
    rows = list(KEY_VARIABLES)
    top = len(rows)
    fig, ax = plt.subplots(figsize=(6.4, 0.5 * top + 2.6))
    for c, (name, report) in enumerate(columns):
        got = received(report, launches[name].env)
        label = f"rank {report['rank']}\npid {report['pid']}"
        ax.text(c + 0.5, top + 0.45, label, ha="center", va="center", fontsize=12)
        for i, var in enumerate(rows):
            value, y = got.get(var), top - 1 - i
            fill = "#3b6ea5" if value is not None else "#eeeeee"
            ax.add_patch(plt.Rectangle((c + 0.04, y + 0.06), 0.92, 0.88, fc=fill))
            ax.text(
                c + 0.5,
                y + 0.5,
                short(value, 9) if value is not None else "—",
                ha="center",
                va="center",
                fontsize=13,
                color="white" if value is not None else "#999",
            )
    for i, var in enumerate(rows):
        ax.text(-0.1, top - 0.5 - i, var, ha="right", va="center", fontsize=12)
    for name, launch in launches.items():
        cs = [c for c, (n, _) in enumerate(columns) if n == name]
        # the launcher over its ranks: every rank's parent is the launcher itself
        assert all(columns[c][1]["ppid"] == launch.pid for c in cs)
        left, right = min(cs) + 0.1, max(cs) + 0.9
        y = top + 1.15
        ax.plot([left, left, right, right], [y - 0.2, y, y, y - 0.2], color="#444")
        ax.text(
            (left + right) / 2,
            y + 0.1,
            f"{name}\npid {launch.pid}",
            ha="center",
            va="bottom",
            fontsize=13,
            weight="bold",
        )
        # under it: how its ranks learn who they are
        extra = set(received(launch.reports[0], launch.env)) - set(rows)
        note = f"+ {len(extra)} more" if extra else "rank: an\nargument"
        ax.text(
            (left + right) / 2,
            -0.15,
            note,
            ha="center",
            va="top",
            fontsize=12,
            style="italic",
        )
    ax.set_xlim(-1.9, len(columns) + 0.02)
    ax.set_ylim(-1.1, top + 2.4)
    ax.axis("off")
    fig.tight_layout(pad=0.2)
    return fig


# --------------------------------------------------------------- mp.spawn, watched
def try_spawn(fn, args: tuple = (), nprocs: int = 2, timeout: float = 60.0) -> str:
    """``mp.spawn(fn, args, nprocs)`` with a deadline; ``"ok"`` or the error, in
    one line.

    The children's tracebacks (they write to the inherited stderr) are captured, and the
    last line of them is returned with the parent's exception.
    """
    with tempfile.TemporaryFile() as err, contextlib.redirect_stderr(io.StringIO()):
        saved = os.dup(2)
        # the children inherit fd 2: their tracebacks land in err
        os.dup2(err.fileno(), 2)
        try:
            ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    return f"timed out after {timeout:.0f} s; the children were killed"
            return "ok"
        except Exception as exc:  # noqa: BLE001 -- reported, not handled
            err.seek(0)
            lines = [
                ln
                for ln in err.read().decode(errors="replace").splitlines()
                if ln.strip()
            ]
            child = f"; a child said: {lines[-1].strip()}" if lines else ""
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}{child}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
