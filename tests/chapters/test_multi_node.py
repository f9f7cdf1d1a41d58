"""Multi-node: what book/multi_node.md does not run. The page runs the nodes (the
rendezvous, a node that never arrives, the SLURM script training lab 2 against lab 1's
baseline, an --out on each node's own disk) and asserts each result on every build; here
are the error paths and the plumbing: a timeout that reaches every process, a taken
rendezvous port, the batch script's syntax and directives, and a worker that starts
without torch.
"""

import os
import socket
import subprocess
import sys

import pytest

from distlab.chapters.multi_node import (
    EMULATED_SLURM,
    SBATCH_SCRIPT,
    reports,
    run_nodes,
    run_sbatch_emulated,
    sbatch_directives,
    torchrun_command,
)
from distlab.infra.launch import LaunchTimeout
from distlab.infra.ports import PortInUse, free_port
from distlab.infra.processes import alive


def test_the_worker_imports_no_torch():
    """The page starts 7 such workers: each would pay seconds of CPU for an import it
    never uses."""
    probe = (
        "import sys, distlab.chapters.multi_node; print(sorted(m for m in "
        "sys.modules if m.split('.')[0] == 'torch'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (
        proc.stdout[:500] + proc.stderr[-2000:]
    )


def test_a_timeout_kills_processes_in_sessions_of_their_own(tmp_path):
    """torchrun starts each worker in a session of its own, and each node runs in one:
    the timeout must reach them all. One node is a real torchrun (forked from the fork
    server) whose worker sleeps; the other a stand-in for it, a plain process whose
    child does the same."""
    worker_pid, grandchild_pid = tmp_path / "worker.pid", tmp_path / "grandchild.pid"
    sleeper = [
        "--no-python",
        "bash",
        "-c",
        f"echo $BASHPID > {worker_pid}; exec sleep 300",
    ]
    node = torchrun_command(
        sleeper,
        nnodes=1,
        nproc_per_node=1,
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="slow",
    )
    stand_in = [
        sys.executable,
        "-c",
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        f"open({str(grandchild_pid)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(300)\n",
    ]
    with pytest.raises(
        LaunchTimeout, match="every process of every node was killed"
    ) as info:
        run_nodes([node, stand_in], timeout=5)
    # ended by our SIGTERM, not by its 300 s sleep
    assert "node 1 (exit status -15)" in str(info.value)
    assert not alive(int(worker_pid.read_text())) and not alive(
        int(grandchild_pid.read_text())
    )


def test_a_taken_rendezvous_port_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        node = torchrun_command(
            ["-m", "distlab.chapters.multi_node"],
            nnodes=2,
            nproc_per_node=1,
            endpoint=f"127.0.0.1:{port}",
            run_id="taken",
        )
        with pytest.raises(PortInUse):
            run_nodes([node, node], timeout=30, port=port)
        # the batch script checks too, on the first node, before any srun
        log = tmp_path / "srun.log"
        job = run_sbatch_emulated(
            ["--steps", "1"],
            port=port,
            timeout=30,
            env={"SRUN_LOG": str(log)},
            check_port=False,
        )
    assert job.returncode == 1
    assert f"error: port {port} on localhost is in use" in job.stderr
    assert not log.exists()  # no srun ran


# ---------------------------------------------------------------- the SLURM script
def test_the_batch_script_parses():
    proc = subprocess.run(
        ["bash", "-n", str(SBATCH_SCRIPT)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert sbatch_directives() == {
        "job-name": "lab2-ddp",
        "nodes": "2",
        "ntasks-per-node": "1",
        "gpus-per-node": "8",
        "cpus-per-task": "64",
        "time": "01:00:00",
        "output": "%x-%j.out",
    }
    for shim in ("srun", "scontrol"):
        assert os.access(EMULATED_SLURM / shim, os.X_OK), (
            f"{shim} stand-in is not executable"
        )


def test_reports_reads_two_workers_writes_that_met_on_one_line():
    # a node's workers share its stdout; under load one line once held two reports
    text = '{"RANK": "0", "env": {"a": 1}}{"RANK": "1"}\n{"RANK": "2"}\n'
    assert [r["RANK"] for r in reports(text)] == ["0", "1", "2"]
