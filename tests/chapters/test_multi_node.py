"""Multi-node: torchrun "nodes" on this machine (127.0.0.1), and the SLURM script on emulated nodes.

Each node is one real torchrun process with ``--nnodes=2`` and a c10d rendezvous; only the
machines are not real. The losses of a run are compared with lab 1's baseline (one process,
the whole batch) with the tolerance tests/labs/test_lab2_ddp.py uses for 2 ranks on one node:
relative 1e-5 per step.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab.chapters.multi_node import (
    EMULATED_SLURM,
    SBATCH_SCRIPT,
    run_nodes,
    run_sbatch_emulated,
    sbatch_directives,
    torchrun_command,
)
from distlab.infra.launch import LaunchTimeout
from distlab.infra.ports import PortInUse, free_port
from distlab.infra.processes import alive
from distlab.metrics import read_metrics, read_summary
from support.labs import BASELINE

STEPS = 4  # the baseline's warm-up covers its first 20 steps, so its first 4 losses are a 4-step run's
LAB2_ARGS = [
    "--preset",
    "tiny",
    "--steps",
    STEPS,
    "--batch-size",
    "16",
    "--seed",
    "1337",
    "--eval-every",
    "1000",
    "--eval-batches",
    "2",
    "--sample-chars",
    "0",
    "--no-progress",
]


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


def test_two_nodes_train_like_one_process(tmp_path):
    port = free_port()
    node = torchrun_command(
        ["src/labs/lab2_ddp.py", *LAB2_ARGS, "--out", tmp_path],
        nnodes=2,
        nproc_per_node=1,
        endpoint=f"127.0.0.1:{port}",
        run_id="two-nodes",
    )
    a, b = run_nodes([node, node], timeout=120, port=port, env={"OMP_NUM_THREADS": "1"})  # 2 ranks, 2 cores
    assert (a.returncode, b.returncode) == (0, 0), a.stderr[-2000:] + b.stderr[-2000:]
    assert read_summary(tmp_path)["world_size"] == 2
    assert losses(tmp_path) == pytest.approx(BASELINE["losses"][:STEPS], rel=1e-5)


def test_the_rendezvous_assigns_node_ranks_and_master_addr(tmp_path):
    """Node a starts first (so it hosts the rendezvous store) and asks for --node-rank=0;
    node b says --local-addr=127.0.0.1, which sorts before a's name, and asks for 1."""
    port = free_port()
    common = dict(nnodes=2, nproc_per_node=2, endpoint=f"127.0.0.1:{port}", run_id="anatomy")
    a = torchrun_command(["-m", "distlab.chapters.multi_node"], **common, extra=["--node-rank=0"])
    b = torchrun_command(
        ["-m", "distlab.chapters.multi_node"], **common, extra=["--node-rank=1", "--local-addr=127.0.0.1"]
    )
    # MASTER_ADDR/PORT exported to torchrun do not reach the workers: torchrun sets its own
    nodes = run_nodes(
        [a, b], timeout=60, port=port, first_alone=True, env={"MASTER_ADDR": "203.0.113.9", "MASTER_PORT": "1"}
    )
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].stderr + nodes[1].stderr
    seen = [[json.loads(line) for line in n.stdout.splitlines()] for n in nodes]
    group_ranks = [{w["GROUP_RANK"] for w in workers} for workers in seen]
    assert group_ranks == [{"1"}, {"0"}]  # by sorted address: --node-rank is ignored ...
    assert "node_rank is only used for static rdzv_backend" in nodes[1].stderr  # ... with a warning
    workers = sorted((w for ws in seen for w in ws), key=lambda w: int(w["RANK"]))
    assert [(w["RANK"], w["GROUP_RANK"], w["LOCAL_RANK"]) for w in workers] == [
        ("0", "0", "0"),
        ("1", "0", "1"),
        ("2", "1", "0"),
        ("3", "1", "1"),
    ]
    assert {(w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"], w["GROUP_WORLD_SIZE"]) for w in workers} == {("4", "2", "2")}
    # the workers' store: on node rank 0, at its --local-addr, on a port of its own
    assert {w["MASTER_ADDR"] for w in workers} == {"127.0.0.1"}
    assert len({w["MASTER_PORT"] for w in workers}) == 1 and workers[0]["MASTER_PORT"] != str(port)
    assert all(w["master_store_answers"] for w in workers)
    assert {w["TORCHELASTIC_USE_AGENT_STORE"] for w in workers} == {"True"}


def test_a_node_that_never_arrives_fails_in_seconds():
    port = free_port()
    lonely = torchrun_command(
        ["-m", "distlab.chapters.multi_node"],
        nnodes=2,
        nproc_per_node=1,
        endpoint=f"127.0.0.1:{port}",
        run_id="lonely",
        extra=["--rdzv-conf=join_timeout=1"],
    )
    (node,) = run_nodes([lonely], timeout=60, port=port)
    assert node.returncode != 0
    assert node.last_line() == "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"
    assert node.stdout == ""  # no worker ever started
    assert 1 <= node.seconds < 20, node.seconds


def test_a_timeout_kills_processes_in_sessions_of_their_own(tmp_path):
    """torchrun starts each worker in a new session; the stand-in here does the same, and
    the timeout must still reach it."""
    pid_file = tmp_path / "grandchild.pid"
    parent = [
        sys.executable,
        "-c",
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(300)\n",
    ]
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match="every process of every node was killed"):
        run_nodes([parent], timeout=3)
    assert time.monotonic() - start < 10
    assert not alive(int(pid_file.read_text()))


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
        job = run_sbatch_emulated(["--steps", "1"], port=port, timeout=30, env={"SRUN_LOG": str(log)}, check_port=False)
    assert job.returncode == 1
    assert f"error: port {port} on localhost is in use" in job.stderr
    assert not log.exists()  # no srun ran


# ---------------------------------------------------------------- the SLURM script
def test_the_batch_script_parses():
    proc = subprocess.run(["bash", "-n", str(SBATCH_SCRIPT)], capture_output=True, text=True, timeout=30)
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
        assert os.access(EMULATED_SLURM / shim, os.X_OK), f"{shim} stand-in is not executable"


def test_the_batch_script_trains_lab_2_on_emulated_nodes(tmp_path):
    port, log = free_port(), tmp_path / "srun.log"
    job = run_sbatch_emulated(
        [*LAB2_ARGS, "--out", tmp_path / "run"],
        port=port,
        timeout=120,
        env={"NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1", "SRUN_LOG": str(log)},
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert losses(tmp_path / "run") == pytest.approx(BASELINE["losses"][:STEPS], rel=1e-5)
    # one preflight line per node, then one torchrun per node with the job's rendezvous
    assert sorted(line.split(":")[0] for line in job.stdout.splitlines() if line.startswith("node ")) == [
        "node 0",
        "node 1",
    ]
    preflight, launch = log.read_text().splitlines()
    assert preflight.startswith("--ntasks-per-node=1 bash -c ")
    assert launch.split() == [
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--kill-on-bad-exit=1",
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        f"--rdzv-id={port}",
        "--rdzv-conf=join_timeout=300",
        "src/labs/lab2_ddp.py",
        *map(str, LAB2_ARGS),
        "--out",
        str(tmp_path / "run"),
    ]  # lab options as given


# ---------------------------------------------------------------- --out on every node's own disk
def test_an_out_folder_that_is_not_shared_saves_without_error_and_cannot_be_resumed(tmp_path):
    from distlab.chapters.checkpoints import save_on_local_disks
    from distlab.checkpoint import inspect_checkpoint
    from distlab.errors import UserError

    saved = save_on_local_disks(tmp_path)
    assert [node["returncode"] for node in saved.values()] == [0, 0], [node["stderr"] for node in saved.values()]
    assert sorted(node["rank"] for node in saved.values()) == [0, 1]
    by_rank = {node["rank"]: node for node in saved.values()}
    # rank 0 wrote its own shard and the index into the folder it sees; rank 1 its shard into its own
    assert {path for path, _ in by_rank[0]["files"]} == {
        f"checkpoints/step_000002/{name}" for name in (".metadata", "__0_0.distcp", "train_state.json")
    }
    assert [path for path, _ in by_rank[1]["files"]] == ["checkpoints/step_000002.partial/__1_0.distcp"]
    with pytest.raises(UserError, match=r"__1_0\.distcp is missing: the checkpoint is incomplete"):
        inspect_checkpoint(by_rank[0]["out"] / "checkpoints" / "step_000002")  # --resume's first check
