"""Lab 1 as a user runs it: files written, losses on baseline, bad input refused in one line."""

import hashlib
import json
import math
import shutil

import pytest

from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_metrics, read_summary
from distlab.model import GPT, preset
from support.labs import BASELINES, run_lab

BASELINE = BASELINES / "lab1_tiny_fp32.json"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab1")
    baseline = json.loads(BASELINE.read_text())
    proc = run_lab("lab1_single.py", *baseline["args"], "--out", out)
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
    assert (summary["preset"], summary["strategy"], summary["world_size"]) == ("tiny", "single", 1)
    assert summary["final_train_loss"] == metrics[-1]["loss"]
    assert summary["final_val_loss"] == metrics[-1]["val_loss"]
    assert summary["parameters"] == 108_352
    state = summary["state_bytes_per_rank"]
    # fp32 AdamW: 4 bytes weight + 4 gradient + 8 moments per parameter, + 4 per step counter
    assert state["params"] == state["grads"] == 4 * 108_352
    n_tensors = len(list(GPT(preset("tiny")).parameters()))  # 2 blocks x 12 + 4
    assert state["optimizer"] == 8 * 108_352 + 4 * n_tensors
    assert 0 < summary["mfu"] < 1.5 and summary["tokens_per_s"] > 0
    assert summary["sample"]


def test_first_20_losses_match_the_stored_baseline(tiny_run):
    """Same preset, seed and data: the same losses, within a tolerance that allows for a
    different CPU's float rounding (fp32 summation order differs between kernels)."""
    out, _ = tiny_run
    baseline = json.loads(BASELINE.read_text())
    losses = [m["loss"] for m in read_metrics(out)]
    assert losses == pytest.approx(baseline["losses"], abs=baseline["abs_tolerance"])
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
    proc = run_lab("lab1_single.py", "--steps", "5", "--no-progress", "--out", tmp_path, *args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_data_file_that_is_not_utf8_is_refused(tmp_path):
    latin1 = tmp_path / "corpus.txt"
    latin1.write_bytes("À bientôt, Roméo.\n".encode("latin-1") * 200)
    proc = run_lab("lab1_single.py", "--steps", "2", "--data", latin1, "--out", tmp_path)
    assert proc.returncode != 0 and "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_every_flag_with_its_comment():
    proc = run_lab("lab1_single.py", "--help")
    assert proc.returncode == 0
    assert "--batch-size" in proc.stdout and "sequences per optimizer step" in proc.stdout
    assert "torchrun" in proc.stdout  # the docstring's launch commands


def test_bf16_autocast_runs(tmp_path):
    proc = run_lab(
        "lab1_single.py", "--steps", "3", "--dtype", "bf16", "--no-progress", "--sample-chars", "0", "--out", tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    summary = read_summary(tmp_path)
    assert summary["dtype"] == "bf16" and math.isfinite(summary["final_train_loss"])


def test_shakespeare_preset_trains_and_its_loss_falls(tmp_path):
    proc = run_lab(
        "lab1_single.py",
        "--preset",
        "shakespeare",
        "--steps",
        "8",
        "--batch-size",
        "4",
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


def test_a_stopped_run_resumed_with_latest_gives_the_losses_of_never_stopping(tmp_path):
    """Checkpointing is lab 1's, in one process with no process group: 6 steps straight (saving
    after 3 and 6) vs a run stopped after its step-3 save and resumed with --resume latest."""
    args = ["--steps", "6", "--checkpoint-every", "3", "--eval-batches", "2", "--sample-chars", "0", "--no-progress"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = run_lab("lab1_single.py", *args, "--out", straight)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    assert json.loads((straight / "checkpoints" / "step_000003" / "train_state.json").read_text())["world_size"] == 1
    # what the stopped run left in its OUT: the checkpoint of step 3 and the log of steps 0-2
    shutil.copytree(straight / "checkpoints" / "step_000003", stopped / "checkpoints" / "step_000003")
    before = (straight / "metrics.jsonl").read_text().splitlines(keepends=True)[:3]
    (stopped / "metrics.jsonl").write_text("".join(before))

    proc = run_lab("lab1_single.py", *args, "--resume", "latest", "--out", stopped)
    assert proc.returncode == 0, proc.stderr
    assert "at step 3" in proc.stdout and "RNG reseeded" not in proc.stdout, proc.stdout
    assert "single process" not in proc.stderr  # DCP's warning about running without a group is ours to expect
    assert [m["step"] for m in read_metrics(stopped)] == [3, 4, 5]
    straight_losses = [m["loss"] for m in read_metrics(straight)]
    assert [m["loss"] for m in read_metrics(stopped)] == straight_losses[3:]  # exactly: same bits
    assert read_summary(stopped)["final_val_loss"] == read_summary(straight)["final_val_loss"]
    assert (stopped / "metrics.before_step_000003.jsonl").read_text() == "".join(before)  # kept aside


def test_the_model_file_is_frozen():
    """Parallelism is applied from outside; model.py stays byte-identical from lab 1 to
    lab 6. A deliberate change to the model updates the stored hash in the same commit."""
    digest = hashlib.sha256((REPO_ROOT / "src" / "distlab" / "model.py").read_bytes()).hexdigest()
    assert digest == (BASELINES / "model.py.sha256").read_text().strip()
