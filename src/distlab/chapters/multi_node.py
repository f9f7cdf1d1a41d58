"""Several torchrun "nodes" on one machine: a multi-node job you can run on a laptop.

    port = free_port()  # distlab.infra.ports
    node = torchrun_command(["src/labs/lab2_ddp.py", "--steps", "5"], nnodes=2,
                            nproc_per_node=1, endpoint=f"127.0.0.1:{port}",
                            run_id="demo")
    # as on two machines
    a, b = run_nodes([node, node], timeout=120, env={"OMP_NUM_THREADS": "1"})
    print(a.returncode, b.returncode, a.seconds)

On a cluster every machine runs the same ``torchrun --nnodes=K ...`` command and the K
launchers find each other through a rendezvous at one ``host:port``. Here the K
launchers are K processes started from this one (each torchrun forked from a server that
imported torch once: ``distlab.infra.forked_torchrun``), and the host is 127.0.0.1: the
rendezvous, the stores, the ranks and the network traffic between them are real; only
the machines are not.

Each node runs in a session of its own, and torchrun starts every worker in a session of
its own too, so a timeout kills the process group of every process in each node's tree
(launcher and workers), not only the launcher: nothing is left running.

Run as a module under torchrun (``torchrun ... -m distlab.chapters.multi_node``), this
file is a worker that prints, as one JSON line, what torchrun told it: the environment
variables of ``WORKER_ENV`` and whether MASTER_ADDR resolves and accepts a connection.
It imports no torch, so such a worker starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from distlab.infra.forked_torchrun import TORCHRUN, start_node
from distlab.infra.paths import REPO_ROOT
from distlab.infra.ports import check_port_free
from distlab.infra.processes import kill_tree

__all__ = [
    "Node",
    "torchrun_command",
    "run_nodes",
    "shell",
    "WORKER_ENV",
    "sbatch_directives",
]
__all__ += ["run_sbatch_emulated", "SBATCH_SCRIPT", "EMULATED_SLURM"]

# what torchrun (its elastic agent) sets in every worker's environment
WORKER_ENV = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "OMP_NUM_THREADS",
]


@dataclass
class Node:
    """One torchrun "node" that has finished: its command, exit status and output."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from its start to its exit

    def last_line(self) -> str:
        """The last non-empty line of stderr: where torchrun and Python put
        the cause."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def torchrun_command(
    target: list[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    run_id: str,
    extra: list[str] = (),
) -> list[str]:
    """The command one node runs: the same on every node, as on a cluster.

    ``target`` is what follows torchrun's own options: a script and its arguments, or
    ``["-m", "module"]``. ``extra`` holds further torchrun options
    (``--local-addr=...``, ``--rdzv-conf=join_timeout=5``, ...).
    """
    return [
        *TORCHRUN,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        *extra,
        *map(str, target),
    ]


def shell(command: list[str]) -> str:
    """A command as a person would type it: ``torchrun``, paths relative to
    the repository."""
    if command[: len(TORCHRUN)] == TORCHRUN:
        command = ["torchrun", *command[len(TORCHRUN) :]]
    return shlex.join(command).replace(f"{REPO_ROOT}/", "")


def _node_env(env: dict | None) -> dict[str, str]:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT / "src"), env.get("PYTHONPATH")])
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TQDM_DISABLE", "1")
    return env


def _local_rendezvous_ports(commands: list[list[str]]) -> set[int]:
    """The ports of the ``--rdzv-endpoint=127.0.0.1:PORT`` (or localhost) options in
    ``commands``."""
    ports = set()
    for arg in (a for c in commands for a in c):
        host, _, port = arg.removeprefix("--rdzv-endpoint=").rpartition(":")
        if (
            arg.startswith("--rdzv-endpoint=")
            and host in ("127.0.0.1", "localhost")
            and port.isdigit()
        ):
            ports.add(int(port))
    return ports


def _joined(command: list[str], port: int) -> bool:
    """Whether the launcher of ``command`` has joined its c10d rendezvous at
    127.0.0.1:``port``: its store answers and holds the rendezvous state, not the c10d
    backend's placeholder."""
    with socket.socket() as probe:
        probe.settimeout(0.2)
        if probe.connect_ex(("127.0.0.1", port)) != 0:
            return False
    # imported here only: the worker starts without torch
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    # torchrun's
    run_id = next(
        (a[len("--rdzv-id=") :] for a in command if a.startswith("--rdzv-id=")), "none"
    )
    try:
        store = TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            timeout=timedelta(seconds=5),
            wait_for_workers=False,
        )
        key = f"torch.rendezvous.{run_id}"
        return (
            store.check([key])
            and store.get(key).decode() != C10dRendezvousBackend._NULL_SENTINEL
        )
    except RuntimeError:  # the store went away (its launcher failed): not joined
        return False


def run_nodes(
    commands: list[list[str]],
    timeout: float,
    env: dict | None = None,
    port: int = 0,
    first_alone: bool = False,
    cwd: str | os.PathLike = REPO_ROOT,
) -> list[Node]:
    """Run each command as one node, all at once; wait for all of them (at most
    ``timeout`` seconds, then kill every process of every node and raise
    ``LaunchTimeout``).

    ``env`` is added to this process's environment. The nodes share this machine's
    cores: set ``OMP_NUM_THREADS`` so that all workers of all nodes together use one
    thread per core (torchrun sets 1 only where it starts two or more workers and the
    variable is unset).

    Every rendezvous port on this machine, ``port`` and those the commands name in
    ``--rdzv-endpoint=127.0.0.1:PORT``, is checked to be free before anything starts
    (``PortInUse`` if not: a c10d rendezvous on a port that another program listens on
    waits forever). ``first_alone``: of the commands that name the same endpoint, start
    the first, and the others only once it has joined the rendezvous there
    (``--rdzv-id``): the first then hosts the rendezvous store, and it has joined the
    rendezvous before the others.
    """
    for p in {port, *_local_rendezvous_ports(commands)} - {0}:
        check_port_free(p)
    endpoint = [min(_local_rendezvous_ports([c]), default=0) for c in commands]
    # port -> its first command
    leaders = {p: i for i, p in reversed(list(enumerate(endpoint)))}
    order = sorted(
        range(len(commands)),
        key=lambda i: (first_alone and leaders.get(endpoint[i]) != i, i),
    )
    env = _node_env(env)
    # torchrun leaves a log folder per launcher in the temporary folder: give the nodes
    # their own
    scratch = tempfile.TemporaryDirectory(prefix="distlab-nodes-")
    env["TMPDIR"] = scratch.name
    deadline = time.monotonic() + timeout
    procs, starts, ends, outs = [None] * len(commands), [None] * len(commands), [], []
    try:
        for i in order:
            if first_alone and endpoint[i] and leaders[endpoint[i]] != i:
                leader = procs[leaders[endpoint[i]]]
                first = commands[leaders[endpoint[i]]]
                while (
                    not _joined(first, endpoint[i])
                    and leader.poll() is None
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.05)
            outs.append(
                (i, *(Path(scratch.name, f"node{i}.{name}") for name in ("out", "err")))
            )
            # files, not pipes: no pipe fills up
            outs[-1][1].touch(), outs[-1][2].touch()
            # a session of its own (its process group is not ours: a timeout can kill
            # it whole)
            procs[i] = start_node(commands[i], *outs[-1][1:], env=env, cwd=cwd)
            starts[i] = time.monotonic()
        ends = [None] * len(procs)
        while None in ends and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if ends[i] is None and proc.poll() is not None:
                    ends[i] = time.monotonic()
            time.sleep(0.05)
    finally:
        for proc in filter(None, procs):
            # nothing left to kill for a node that exited with its workers
            kill_tree(proc.pid)
            proc.wait()
        texts = [("", "")] * len(commands)
        for i, out, err in outs:
            texts[i] = (out.read_text(), err.read_text())
        scratch.cleanup()
    if None in ends:
        # imports torch: not in the worker, which must start fast
        from distlab.infra.launch import LaunchTimeout

        tails = "".join(
            f"\n--- node {i} (exit status {p.returncode}), last lines of stderr:\n"
            + "\n".join(err.splitlines()[-5:])
            for i, (p, (_, err)) in enumerate(zip(procs, texts))
            if p is not None
        )
        raise LaunchTimeout(
            f"{len(commands)} node(s) did not finish within {timeout:.0f} s; "
            f"every process of every node was killed{tails}"
        )
    return [
        Node(command, proc.returncode, out, err, end - start)
        for command, proc, start, end, (out, err) in zip(
            commands, procs, starts, ends, texts
        )
    ]


# ---------------------------------------------------------------- SLURM, emulated
SBATCH_SCRIPT = REPO_ROOT / "src" / "slurm" / "lab2_multinode.sbatch"
# stand-ins for srun and scontrol
EMULATED_SLURM = REPO_ROOT / "src" / "slurm" / "emulated"


def sbatch_directives(script: str | os.PathLike = SBATCH_SCRIPT) -> dict[str, str]:
    """The ``#SBATCH --name=value`` options of a batch script, read as sbatch reads
    them: from the top, up to the first line that is neither a comment nor blank."""
    options = {}
    for line in Path(script).read_text().splitlines()[1:]:  # after the #! line
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            name, _, value = line.split()[1].lstrip("-").partition("=")
            options[name] = value
    return options


def run_sbatch_emulated(
    args: list[str],
    *,
    port: int,
    timeout: float,
    env: dict | None = None,
    script: str | os.PathLike = SBATCH_SCRIPT,
    check_port: bool = True,
) -> Node:
    """Run a batch script as ``sbatch script *args`` would, on emulated nodes of
    this machine.

    Emulated: sbatch (this function sets the variables SLURM gives a batch job, with the
    node count and CPUs per task read from the script's ``#SBATCH`` lines, and runs the
    script with bash), srun and scontrol (the scripts in ``EMULATED_SLURM``, first on
    PATH). ``RDZV_PORT`` is set to ``port``, as a user may set it when submitting. Real:
    every line of the batch script, torchrun, the rendezvous, the training. All nodes
    are called ``localhost``, which resolves to this machine. ``check_port=False``
    leaves checking that ``port`` is free to the script.
    """
    directives = sbatch_directives(script)
    nnodes = int(directives["nodes"])
    batch_env = {
        "PATH": os.pathsep.join(
            [str(EMULATED_SLURM), str(Path(sys.executable).parent), os.environ["PATH"]]
        ),
        "SLURM_JOB_ID": str(port),
        "SLURM_JOB_NAME": Path(script).stem,  # a job id unique to this run
        "SLURM_JOB_NODELIST": ",".join(["localhost"] * nnodes),
        "SLURM_NNODES": str(nnodes),
        "SLURM_JOB_NUM_NODES": str(nnodes),
        "SLURM_SUBMIT_DIR": str(REPO_ROOT),
        **(
            {"SLURM_CPUS_PER_TASK": directives["cpus-per-task"]}
            if "cpus-per-task" in directives
            else {}
        ),
        "RDZV_PORT": str(port),
        **(env or {}),
    }
    return run_nodes(
        [["bash", str(script), *map(str, args)]],
        timeout=timeout,
        env=batch_env,
        port=port if check_port else 0,
    )[0]


# ---------------------------------------------------------------- the worker
def report() -> dict:
    """What this worker was told by torchrun, and whether
    MASTER_ADDR:MASTER_PORT answers."""
    seen = {key: os.environ.get(key) for key in WORKER_ENV}
    addr, port = seen["MASTER_ADDR"], int(seen["MASTER_PORT"] or 0)
    try:
        seen["master_resolves_to"] = sorted(
            {
                info[4][0]
                for info in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            }
        )
    except (socket.gaierror, TypeError):
        seen["master_resolves_to"] = []
    try:
        with socket.create_connection((addr, port), timeout=5):
            seen["master_store_answers"] = True
    except (OSError, TypeError):
        seen["master_store_answers"] = False
    seen["pid"] = os.getpid()
    return seen


def reports(text: str) -> list[dict]:
    """Every JSON object the workers printed into ``text``, even two on one line: the
    workers of a node share its output, and under load their writes can meet."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        report_, end = decoder.raw_decode(text, at)
        found.append(report_)
        at = text.find("{", end)
    return found


if __name__ == "__main__":
    # one write call, line and newline together, well under a pipe's atomic size
    sys.stdout.write(json.dumps(report()) + "\n")
    sys.stdout.flush()
