"""Running the lab scripts as a reader would, and the baseline they are held to."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from distlab.infra.paths import LABS_DIR
from distlab.infra.ports import free_port
from distlab.infra.processes import kill_tree

BASELINES = Path(__file__).parent / "baselines"
# lab 1's run of the tiny model (support/make_baseline.py); every distributed lab must
# match it: its losses, and past the warm-up its gradient norms (support.compare)
BASELINE = json.loads((BASELINES / "lab1_tiny_fp32.json").read_text())
# {"step", "loss", "grad_norm"} of each of its steps; with its constant learning rate
# after the warm-up, the first N of them are any N-step run's with the same options
BASELINE_RECORDS = BASELINE["records"]
BASELINE_LOSSES = [r["loss"] for r in BASELINE_RECORDS]
# the steps before this one are the warm-up's: compare gradient norms from here on
WARMUP = BASELINE["warmup_steps"]
# how far, relative, an fp32 CPU run of any lab may part from the baseline, in loss and
# gradient norm. Measured here (2 cores, torch 2.13), 20 steps: lab 1 and every one-
# process run of a later lab give its bits; 2-4 ranks, micro-batches, FSDP2, AC and
# Accelerate part by at most 1.4e-7 (loss) and 2.8e-7 (gradient norm, lab 5 on 2 ranks).
# The baseline was made on one CPU and is read on others, whose kernels add in another
# order: 1e-5, as the loss checks always allowed; a gradient N times off moves the norm
# by a factor N.
FP32_RTOL = 1e-5


def baseline_args(steps: int) -> list[str]:
    """The baseline run's options for its first ``steps`` steps (evaluated once, at
    the end), no sample."""
    args = list(BASELINE["args"])
    for option, value in (
        ("--steps", steps),
        ("--eval-every", steps),
        ("--sample-chars", 0),
    ):
        args[args.index(option) + 1] = str(value)
    return args


def run_lab(
    script: str, *args, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``src/labs/<script>`` as a user would, in a subprocess; never raises
    on failure."""
    return subprocess.run(
        [sys.executable, str(LABS_DIR / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def torchrun(
    script: str, nprocs: int, *args, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`torchrun --standalone` as the README shows it (port 0: the OS picks a
    free one)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nprocs}",
            str(LABS_DIR / script),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def each_rank(
    script: str, nprocs: int, *args, timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """The ranks `torchrun --standalone` would start, as plain processes with torchrun's
    environment (RANK, LOCAL_RANK, WORLD_SIZE, a free MASTER_PORT on 127.0.0.1), each
    with its own stdout and stderr, read after every rank has exited; by rank.

    For a test that expects every rank to report something: under torchrun, the first
    rank to fail makes the agent SIGTERM the others, which may not have printed yet (a
    race that once failed CI). Here no rank is stopped by another's exit; a rank still
    running at ``timeout`` is killed, and the test sees its (empty) output."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(LABS_DIR / script), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nprocs),
                "LOCAL_WORLD_SIZE": str(nprocs),
            },
        )
        for rank in range(nprocs)
    ]
    deadline = time.monotonic() + timeout
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def start_lab(
    script: str, *args, nprocs: int = 0, rank: int | None = None, port: int = 0
) -> subprocess.Popen:
    """Start a lab without waiting: under ``torchrun --standalone`` with ``nprocs``
    ranks, or, with ``rank``, as that one rank of ``nprocs`` plain processes that meet
    on 127.0.0.1:``port`` (as ``each_rank`` starts them), or else as one process."""
    if nprocs and rank is None:
        launch = ["-m", "torch.distributed.run", "--standalone"]
        launch.append(f"--nproc-per-node={nprocs}")
    else:
        launch = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if rank is not None:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nprocs),
            LOCAL_WORLD_SIZE=str(nprocs),
        )
    return subprocess.Popen(
        [sys.executable, *launch, str(LABS_DIR / script), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # a group of its own, for kill_tree
    )


@contextlib.contextmanager
def ended(*procs: subprocess.Popen):
    """On leaving the block, however: every process still running there, and all its
    workers, killed; a failed test leaves no lab behind."""
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)


def wait_for_logged_steps(out: Path, steps: int, procs, timeout: float = 120) -> None:
    """Until OUT/metrics.jsonl has ``steps`` lines; fails if a process ends first."""
    metrics = Path(out) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"ended before step {steps}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no step {steps} in {timeout} s")
        time.sleep(0.05)
