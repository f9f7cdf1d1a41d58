"""Lab 1 as a user runs it: files written, losses on baseline, bad input refused in
one line."""

import hashlib
import json
import math
import shutil

import pytest
import torch

from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_metrics, read_summary
from distlab.model import GPT, preset
from support.compare import mismatches
from support.labs import (
    BASELINE_LOSSES,
    BASELINE_RECORDS,
    BASELINES,
    FP32_RTOL,
    WARMUP,
    baseline_args,
    run_lab,
)

BASELINE = BASELINES / "lab1_tiny_fp32.json"


# the baseline's run, saving a checkpoint every 3 steps (the newest 3 kept: steps 12, 15
# and 18)
CHECKPOINTED = ["--checkpoint-every", "3"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run for every test here that reads lab 1 on the baseline's flags."""
    out = tmp_path_factory.mktemp("lab1")
    baseline = json.loads(BASELINE.read_text())
    proc = run_lab("lab1_single.py", *baseline["args"], *CHECKPOINTED, "--out", out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_writes_metrics_and_summary(tiny_run):
    out, _ = tiny_run
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(20))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_s"} <= metrics[0].keys()
    assert "val_loss" in metrics[-1]
    summary = read_summary(out)
    for key in (
        "preset",
        "strategy",
        "world_size",
        "steps",
        "global_batch",
        "tokens_per_s",
        "final_train_loss",
        "final_val_loss",
        "parameters",
        "state_bytes_per_rank",
        "achieved_flops_per_s",
        "mfu",
    ):
        assert key in summary, key
    assert (summary["preset"], summary["strategy"], summary["world_size"]) == (
        "tiny",
        "single",
        1,
    )
    assert summary["final_train_loss"] == metrics[-1]["loss"]
    assert summary["final_val_loss"] == metrics[-1]["val_loss"]
    assert summary["parameters"] == 108_352
    state = summary["state_bytes_per_rank"]
    # fp32 AdamW: 4 bytes weight + 4 gradient + 8 moments per parameter, + 4 per
    # step counter
    assert state["params"] == state["grads"] == 4 * 108_352
    n_tensors = len(list(GPT(preset("tiny")).parameters()))  # 2 blocks x 12 + 4
    assert state["optimizer"] == 8 * 108_352 + 4 * n_tensors
    # timed, so how fast depends on the load; how the summary derives its rates from the
    # timing does not
    assert summary["tokens_per_s"] > 0
    # 1 rank
    assert (
        summary["achieved_flops_per_s"]
        == summary["flops_per_token"] * summary["tokens_per_s"]
    )
    ratio = summary["achieved_flops_per_s"] / summary["peak_flops_per_s"]
    # None: the peak was no peak
    assert summary["mfu"] == (pytest.approx(ratio) if ratio <= 1 else None)
    assert summary["sample"]


def test_losses_and_gradient_norms_match_the_stored_baseline(tiny_run):
    """Same preset, seed and data: the same losses, and past the warm-up the same
    gradient norms, within a tolerance that allows for a different CPU's float rounding
    (fp32 summation order differs between kernels). Here: the same bits."""
    out, _ = tiny_run
    baseline = json.loads(BASELINE.read_text())
    metrics = read_metrics(out)
    losses = [m["loss"] for m in metrics]
    assert losses == pytest.approx(BASELINE_LOSSES, abs=baseline["abs_tolerance"])
    assert not mismatches(metrics, BASELINE_RECORDS, rtol=FP32_RTOL, after=WARMUP)
    assert losses[-1] < losses[0] - 0.3  # and it learns


def test_progress_and_results_are_printed(tiny_run):
    _, proc = tiny_run
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--steps", "-1"], "--steps must be 0 or more"),
        (["--batch-size", "-4"], "--batch-size must be positive"),
        (["--steps", "many"], "invalid int value"),
        (["--dtype", "fp8"], "unknown dtype"),
        (["--data", "/no/such/file.txt"], "does not exist"),
        (["--lr", "1e10"], "loss is nan"),
    ],
)
def test_bad_input_ends_with_one_line_and_nonzero_exit(args, message, tmp_path):
    proc = run_lab(
        "lab1_single.py", "--steps", "5", "--no-progress", "--out", tmp_path, *args
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_data_file_that_is_not_utf8_is_refused(tmp_path):
    latin1 = tmp_path / "corpus.txt"
    latin1.write_bytes("À bientôt, Roméo.\n".encode("latin-1") * 200)
    proc = run_lab(
        "lab1_single.py", "--steps", "2", "--data", latin1, "--out", tmp_path
    )
    assert (
        proc.returncode != 0
        and "not UTF-8" in proc.stderr
        and "Traceback" not in proc.stderr
    )


def test_help_lists_every_flag_with_its_comment():
    proc = run_lab("lab1_single.py", "--help")
    assert proc.returncode == 0
    assert (
        "--batch-size" in proc.stdout and "sequences per optimizer step" in proc.stdout
    )
    assert "torchrun" in proc.stdout  # the docstring's launch commands


def test_bf16_autocast_runs(tmp_path):
    proc = run_lab(
        "lab1_single.py",
        "--steps",
        "3",
        "--dtype",
        "bf16",
        "--no-progress",
        "--sample-chars",
        "0",
        "--out",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = read_summary(tmp_path)
    assert summary["dtype"] == "bf16" and math.isfinite(summary["final_train_loss"])


def test_shakespeare_preset_trains_and_its_loss_falls(tmp_path):
    """One sequence of 256 characters a step is enough to see the 10.77M-parameter model
    learn, and its steps are most of this test's time."""
    proc = run_lab(
        "lab1_single.py",
        "--preset",
        "shakespeare",
        "--steps",
        "6",
        "--batch-size",
        "1",
        "--warmup-steps",
        "2",
        "--eval-batches",
        "1",
        "--sample-chars",
        "0",
        "--no-progress",
        "--out",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert read_summary(tmp_path)["parameters"] == 10_770_816
    assert losses[-1] < losses[0] - 0.5


def test_a_stopped_run_resumed_with_latest_gives_the_losses_of_never_stopping(
    tiny_run, tmp_path
):
    """Checkpointing is lab 1's, in one process with no process group: the baseline's
    run (saving every 3 steps, so the same losses as without saving) vs a run stopped
    after its step-15 save and resumed with --resume latest, which must pick step 15
    over step 12."""
    straight, _ = tiny_run
    saved = straight / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == [
        "step_000012",
        "step_000015",
        "step_000018",
    ]
    assert (
        json.loads((saved / "step_000015" / "train_state.json").read_text())[
            "world_size"
        ]
        == 1
    )
    # what the stopped run left in its OUT: the checkpoints of steps 12 and 15, the log
    # of steps 0-14
    stopped = tmp_path / "stopped"
    for step in ("step_000012", "step_000015"):
        shutil.copytree(saved / step, stopped / "checkpoints" / step)
    before = (straight / "metrics.jsonl").read_text().splitlines(keepends=True)[:15]
    (stopped / "metrics.jsonl").write_text("".join(before))

    args = json.loads(BASELINE.read_text())["args"]
    proc = run_lab(
        "lab1_single.py", *args, *CHECKPOINTED, "--resume", "latest", "--out", stopped
    )
    assert proc.returncode == 0, proc.stderr
    assert "at step 15" in proc.stdout and "RNG reseeded" not in proc.stdout, (
        proc.stdout
    )
    # DCP's warning about running without a group is ours to expect
    assert "single process" not in proc.stderr
    assert [m["step"] for m in read_metrics(stopped)] == [15, 16, 17, 18, 19]
    straight_losses = [m["loss"] for m in read_metrics(straight)]
    # exactly: same bits
    assert [m["loss"] for m in read_metrics(stopped)] == straight_losses[15:]
    assert (
        read_summary(stopped)["final_val_loss"]
        == read_summary(straight)["final_val_loss"]
    )
    # kept aside
    assert (stopped / "metrics.before_step_000015.jsonl").read_text() == "".join(before)


def test_model_pt_holds_plain_keys_and_cpu_tensors(tiny_run):
    """Every lab saves CPU tensors (save_plain_weights), so any machine loads any lab's
    model.pt. On this CPU-only machine that holds anyway; the check matters where a GPU
    trained the model."""
    out, _ = tiny_run
    state = torch.load(out / "model.pt", weights_only=True)
    assert {t.device.type for t in state.values()} == {"cpu"}
    GPT(preset("tiny")).load_state_dict(state)


def test_log_every_3_logs_the_same_losses_at_fewer_steps(tiny_run, tmp_path):
    """Between log points the loss stays on the device; a logged step's loss is that
    step's, as with --log-every 1 (the same bits: nothing else changes in the run). A
    step after which a checkpoint is saved is a log point too, so the save runs
    outside every timed window."""
    out, _ = tiny_run
    proc = run_lab(
        "lab1_single.py",
        *json.loads(BASELINE.read_text())["args"],
        "--log-every",
        "3",
        "--checkpoint-every",
        "4",
        "--out",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    every_step = {m["step"]: m for m in read_metrics(out)}
    logged = read_metrics(tmp_path)
    # warm-up, every 3rd, each step before a save (4th), the last
    assert [m["step"] for m in logged] == [0, 1, 2, 3, 5, 7, 8, 11, 14, 15, 17, 19]
    assert [m["loss"] for m in logged] == [
        every_step[m["step"]]["loss"] for m in logged
    ]
    assert logged[-1]["val_loss"] == every_step[19]["val_loss"]
    assert (
        read_summary(tmp_path)["final_train_loss"]
        == read_summary(out)["final_train_loss"]
    )


def test_compile_trains_like_eager_and_keeps_the_plain_names(tmp_path):
    """--compile compiles each block in place: the baseline's first 8 steps (2 past
    the warm-up) give the eager baseline's losses and gradient norms (fp32; Inductor's
    fused kernels round differently, hence a tolerance), and the checkpoint and
    model.pt keep the plain model's names. The one compile test: about 30 s with a cold
    compile cache."""
    from torch.distributed.checkpoint import FileSystemReader

    from distlab.checkpoint.state import MODEL_PREFIX

    args = [*baseline_args(8), "--compile", "--checkpoint-every", "3"]
    proc = run_lab("lab1_single.py", *args, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    metrics = read_metrics(tmp_path)
    # measured: 1.2e-7 (loss), 9.3e-8 (gradient norm); 1e-4 for Inductor's kernels
    # on other CPUs, as the GPU suite allows for its own
    assert not mismatches(metrics, BASELINE_RECORDS[:8], rtol=1e-4, after=WARMUP)
    assert [m["loss"] for m in metrics] == pytest.approx(
        [r["loss"] for r in BASELINE_RECORDS[:8]], rel=1e-4
    )
    plain = set(GPT(preset("tiny")).state_dict())
    assert set(torch.load(tmp_path / "model.pt", weights_only=True)) == plain
    saved = (
        FileSystemReader(str(tmp_path / "checkpoints" / "step_000003"))
        .read_metadata()
        .state_dict_metadata
    )
    assert {
        k.removeprefix(MODEL_PREFIX) for k in saved if k.startswith(MODEL_PREFIX)
    } == plain


def test_the_model_file_is_frozen():
    """Parallelism is applied from outside; model.py stays byte-identical from lab 1 to
    lab 6. A deliberate change to the model updates the stored hash in the same commit.
    """
    # last changed for issue 20: the "gpt2" preset (GPT-2 small's shape, for GPU
    # benchmarks) was added to PRESETS; GPTConfig, GPT and the existing presets
    # are unchanged
    digest = hashlib.sha256(
        (REPO_ROOT / "src" / "distlab" / "model.py").read_bytes()
    ).hexdigest()
    assert digest == (BASELINES / "model.py.sha256").read_text().strip()
