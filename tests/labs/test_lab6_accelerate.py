"""Lab 6 (Accelerate) beyond its page: one process under python and ``accelerate
launch``, and 2 DDP ranks under torchrun resumed under ``accelerate launch``, equal to
lab 1; FSDP it cannot give is refused, never swapped.

The page (labs/lab6_accelerate.md) runs 2 ranks with DDP and with ``--fsdp`` and checks
on every build their losses against lab 2 (within 1e-5), the strategy, the parameter and
AdamW bytes per rank, the saved weights and what ``save_state`` wrote. The Accelerate
chapter runs the three quiet fallbacks (no cpu=True, the FSDP plugin on CPU,
``accelerate launch --cpu``) and asserts that lab 6's checks catch them."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distlab.accel import check_fsdp_request
from distlab.errors import UserError
from distlab.infra.paths import REPO_ROOT
from distlab.infra.ports import free_port
from distlab.metrics import read_metrics, read_summary
from support.compare import mismatches
from support.labs import (
    BASELINE_RECORDS,
    FP32_RTOL,
    WARMUP,
    baseline_args,
    run_lab,
    torchrun,
)

# lab 1's baseline run (support/labs.py), its first 10 steps: the 6 of the warm-up, then
# 4 at the constant peak learning rate, so they are the baseline's first 10 records
TEN_STEPS = baseline_args(10)
LAB1 = BASELINE_RECORDS[:10]
LAB1_LOSSES = {r["step"]: r["loss"] for r in LAB1}


def accelerate_launch(
    nprocs: int, *args, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``accelerate launch`` as the chapter shows it, on a free port of 127.0.0.1."""
    port = free_port()
    # "multi_gpu" is its name for N local processes
    multi = ["--multi_gpu"] if nprocs > 1 else []
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "accelerate"),
            "launch",
            *multi,
            "--num_processes",
            str(nprocs),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            str(REPO_ROOT / "src" / "labs" / "lab6_accelerate.py"),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def losses(out) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(out)}


def norms_off(out) -> list[str]:
    """Where the run in OUT parts from lab 1 past the warm-up, in loss or gradient norm
    (support.compare)."""
    return mismatches(read_metrics(out), LAB1, rtol=FP32_RTOL, after=WARMUP)


def test_ddp_under_torchrun_and_accelerate_launch_equals_lab_1_and_resumes(tmp_path):
    """torchrun, 2 ranks, 2 micro-batches each, checkpoints every 5 steps; then
    accelerate launch resumes step 5: both give lab 1's losses and gradient norms within
    1e-5 relative (measured: 1.2e-7 and 0)."""
    first = tmp_path / "torchrun"
    proc = torchrun(
        "lab6_accelerate.py", 2, *TEN_STEPS, "--checkpoint-every", "5", "--out", first
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not norms_off(first)
    assert losses(first) == pytest.approx(LAB1_LOSSES, rel=FP32_RTOL)
    assert read_summary(first)["strategy"] == "accelerate-ddp+accumulation+ac-full"
    saved = first / "checkpoints" / "step_000005"

    # resumed into the same OUT: the first run's metrics are kept aside, not overwritten
    proc = accelerate_launch(2, *TEN_STEPS, "--resume", saved, "--out", first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "resumed from" in proc.stdout and "2 process(es) of 2 launched" in proc.stdout
    )
    assert (
        len((first / "metrics.before_step_000005.jsonl").read_text().splitlines()) == 10
    )
    resumed = losses(first)
    assert sorted(resumed) == list(range(5, 10))
    lab1 = {s: LAB1_LOSSES[s] for s in resumed}
    assert resumed == pytest.approx(lab1, rel=FP32_RTOL)
    assert not norms_off(first)  # the resumed run's records, now in OUT


def test_one_process_under_python_and_accelerate_launch_is_lab_1(tmp_path):
    """One process with the whole batch (4 micro-batches of 4) trains like lab 1
    (measured: 1.2e-7 in the losses, 0 in the gradient norms past the warm-up)."""
    for name, run in [
        ("python", lambda out: run_lab("lab6_accelerate.py", *TEN_STEPS, "--out", out)),
        ("accelerate", lambda out: accelerate_launch(1, *TEN_STEPS, "--out", out)),
    ]:
        proc = run(tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not norms_off(tmp_path / name), name
        assert losses(tmp_path / name) == pytest.approx(LAB1_LOSSES, rel=FP32_RTOL)
        summary = read_summary(tmp_path / name)
        assert (summary["strategy"], summary["accum_steps"]) == (
            "accelerate-single+accumulation+ac-full",
            4,
        )


def test_fsdp_on_one_process_is_refused_with_one_line(tmp_path):
    proc = run_lab("lab6_accelerate.py", "--fsdp", "--steps", "1", "--out", tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "lab6_accelerate.py: error: --fsdp shards over ranks and one process "
        "has none: launch 2 or more, or drop --fsdp"
    )


@pytest.mark.parametrize("option", [{"checkpoint_every": 5}, {"resume": "latest"}])
def test_fsdp_checkpoints_on_cpu_are_refused(option):
    """Accelerate's save_state would save no model and rank 0's half of
    the optimizer."""
    cfg = SimpleNamespace(
        **{"fsdp": True, "checkpoint_every": 0, "resume": "", **option}
    )
    with pytest.raises(
        UserError, match="save_state cannot save a model Accelerate was not given"
    ):
        check_fsdp_request(cfg, 2, torch.device("cpu"))
    check_fsdp_request(
        SimpleNamespace(fsdp=False, checkpoint_every=5, resume=""),
        2,
        torch.device("cpu"),
    )
