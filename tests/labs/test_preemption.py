"""The labs' preemption handler (``distlab.checkpoint.Preemption``): SIGTERM or SIGUSR1
mid-run saves a checkpoint at the end of the step on every rank and ends the run
cleanly; the same command with ``--resume auto`` then trains exactly as a run that was
never stopped.

Shown failing on a broken handler (each rank deciding alone, no all-reduce of the
flag): the signal to one rank makes that rank enter the save's barrier while the other
runs its next step's all-reduce, and the run dies at ``--timeout-s``."""

import json
import re
import signal

import pytest

from distlab.infra.ports import free_port
from distlab.metrics import read_metrics
from support.compare import mismatches
from support.labs import (
    BASELINE,
    BASELINE_LOSSES,
    BASELINE_RECORDS,
    FP32_RTOL,
    WARMUP,
    ended,
    start_lab,
    torchrun,
    wait_for_logged_steps,
)

# 20 steps of the tiny model, a loss and a gradient norm logged every step
ARGS = [*BASELINE["args"], "--sample-chars", "0"]
# a collective that waits longer than this fails the run: no test hangs
RANKS = [*ARGS, "--timeout-s", "60"]


def trained(out) -> list[tuple]:
    """(step, loss, grad_norm) of every logged step, across a stop and its resume."""
    lines = []
    for part in sorted(out.glob("metrics.before_step_*.jsonl")):
        lines += [json.loads(line) for line in part.read_text().splitlines()]
    lines += read_metrics(out)
    return [(m["step"], m["loss"], m["grad_norm"]) for m in lines]


def stopped_at(output: str) -> int:
    found = re.search(r"preempted after step (\d+): checkpoint saved", output)
    assert found, output[-3000:]
    return int(found.group(1))


def test_sigterm_to_torchrun_saves_and_resume_auto_trains_as_if_never_stopped(
    tmp_path,
):
    whole = tmp_path / "whole"
    proc = torchrun("lab2_ddp.py", 2, *RANKS, "--out", whole)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the uninterrupted run is lab 2 on 2 ranks: lab 1's losses and gradient norms (its
    # page compares the losses only). Measured: 1.3e-7 and 1.1e-7
    records = read_metrics(whole)
    assert not mismatches(records, BASELINE_RECORDS, rtol=FP32_RTOL, after=WARMUP)
    assert [m["loss"] for m in records] == pytest.approx(BASELINE_LOSSES, rel=FP32_RTOL)

    out = tmp_path / "stopped"
    with ended(start_lab("lab2_ddp.py", *RANKS, "--out", out, nprocs=2)) as (run,):
        wait_for_logged_steps(out, 5, [run])
        run.send_signal(signal.SIGTERM)  # as SLURM or Kubernetes would, to torchrun
        stdout, stderr = run.communicate(timeout=120)
    steps = stopped_at(stdout)
    assert 5 <= steps < 20, stdout[-3000:]
    # torchrun passed the signal on to both workers; each one noted it once
    assert stderr.count("SIGTERM: a checkpoint") == 2, stderr[-3000:]
    assert "exitcode" not in stderr, stderr[-3000:]  # no worker failed
    assert (out / "checkpoints" / f"step_{steps:06d}").is_dir()
    assert len(read_metrics(out)) == steps  # nothing logged after the stop

    proc = torchrun("lab2_ddp.py", 2, *RANKS, "--out", out, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step_{steps:06d}" in proc.stdout
    # bit for bit: the model, optimizer, data position and RNG all came back
    assert trained(out) == trained(whole)


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    out, port = tmp_path / "fsdp2", free_port()
    ranks = [
        start_lab("lab4_fsdp2.py", *RANKS, "--out", out, nprocs=2, rank=r, port=port)
        for r in range(2)
    ]
    with ended(*ranks):
        wait_for_logged_steps(out, 3, ranks)
        ranks[1].send_signal(signal.SIGTERM)  # rank 0 never gets it
        done = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (_, stderr) in zip(ranks, done, strict=True):
        assert rank.returncode == 0, stderr[-3000:]
    steps = stopped_at(done[0][0])
    assert "SIGTERM" in done[1][1] and "SIGTERM" not in done[0][1]
    # each rank wrote its own shards into the one checkpoint
    saved = out / "checkpoints" / f"step_{steps:06d}"
    assert sorted(p.name for p in saved.glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


def test_lab1_and_lab6_stop_on_sigusr1_and_go_on(tmp_path):
    """One process, no process group (lab 1) and Accelerate's save_state (lab 6):
    SLURM's ``--signal=USR1@120`` reaches a task started without torchrun."""
    for script in ("lab1_single.py", "lab6_accelerate.py"):
        out = tmp_path / script
        with ended(start_lab(script, *ARGS, "--out", out)) as (run,):
            wait_for_logged_steps(out, 3, [run])
            run.send_signal(signal.SIGUSR1)
            stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr[-3000:]
        steps = stopped_at(stdout)
        with ended(start_lab(script, *ARGS, "--out", out, "--resume", "auto")) as (
            resumed,
        ):
            stdout, stderr = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, stderr[-3000:]
        records = [
            {"step": step, "loss": loss, "grad_norm": norm}
            for step, loss, norm in trained(out)
        ]
        assert len(records) == 20, (script, steps)
        # lab 1 is the baseline; lab 6 on one process, within the labs' tolerance
        # (measured, never stopped: 1.2e-7 in the losses, 1.7e-7 in the gradient norms)
        for got, want in zip(records, BASELINE_LOSSES, strict=True):
            assert abs(got["loss"] - want) <= FP32_RTOL * abs(want), (script, steps)
        assert not mismatches(
            records, BASELINE_RECORDS, rtol=FP32_RTOL, after=WARMUP
        ), (script, steps)
