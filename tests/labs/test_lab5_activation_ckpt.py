"""Lab 5 (FSDP2 + activation checkpointing): the losses of lab 1 without checkpointing
and with selective checkpointing of every 2nd block, the same gradient norms in both,
lab 4's checkpoints resume in it, and bad flags are refused in one line. The page
(labs/lab5_activation_ckpt.md) checks on every build that ``--ac full`` gives lab 4's
losses and gradient norms."""

import pytest
import torch

from distlab.infra.experiment import gpt
from distlab.metrics import read_metrics, read_summary
from support.compare import mismatches
from support.labs import (
    BASELINE,
    BASELINE_LOSSES,
    BASELINE_RECORDS,
    FP32_RTOL,
    WARMUP,
    run_lab,
    torchrun,
)


def test_lab5_gradients_and_losses_equal_lab_1_with_and_without_checkpointing(tmp_path):
    """2 ranks x 2 micro-batches, without and with selective checkpointing: lab 1's
    losses and gradient norms (measured, both modes: 1.2e-7 and 2.8e-7), and each
    other's gradient norms (measured: the same bits)."""
    grad_norms = {}
    for mode, every in (("none", 1), ("selective", 2)):  # full: on the page
        out = tmp_path / mode
        proc = torchrun(
            "lab5_activation_ckpt.py",
            2,
            *BASELINE["args"],
            "--micro-batch-size",
            4,
            "--ac",
            mode,
            "--ac-every",
            every,
            "--out",
            out,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics = read_metrics(out)
        assert not mismatches(metrics, BASELINE_RECORDS, rtol=FP32_RTOL, after=WARMUP)
        assert [m["loss"] for m in metrics] == pytest.approx(
            BASELINE_LOSSES, rel=FP32_RTOL
        )
        grad_norms[mode] = [m["grad_norm"] for m in metrics]
        assert read_summary(out)["strategy"] == f"fsdp2+accumulation+ac-{mode}"
    # the global gradient norm of every step, with and without
    assert grad_norms["selective"] == pytest.approx(grad_norms["none"], rel=1e-6, abs=0)


def test_lab5_resumes_a_lab4_checkpoint_and_saves_plain_weights(tmp_path):
    common = [
        "--steps",
        "6",
        "--eval-batches",
        "1",
        "--sample-chars",
        "0",
        "--no-progress",
    ]
    proc = run_lab(
        "lab4_fsdp2.py", *common, "--checkpoint-every", 3, "--out", tmp_path / "lab4"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_lab(
        "lab5_activation_ckpt.py",
        *common,
        "--ac",
        "selective",
        "--out",
        tmp_path / "lab5",
        "--resume",
        tmp_path / "lab4" / "checkpoints" / "step_000003",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lab4 = [m["loss"] for m in read_metrics(tmp_path / "lab4")]
    lab5 = [m["loss"] for m in read_metrics(tmp_path / "lab5")]
    # the checkpoint's keys are the plain model's, with or without wrappers
    assert lab5 == lab4[3:]
    plain = gpt("tiny", seed=0)
    plain.load_state_dict(torch.load(tmp_path / "lab5" / "model.pt", weights_only=True))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--ac", "ful"], "unknown --ac 'ful'"),
        (["--ac-every", "0"], "--ac-every must be positive"),
    ],
)
def test_lab5_refuses_bad_flags_in_one_line(flags, message):
    proc = run_lab("lab5_activation_ckpt.py", *flags)
    assert proc.returncode != 0 and message in proc.stderr
    assert "Traceback" not in proc.stderr
