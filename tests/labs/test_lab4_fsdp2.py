"""Lab 4 (lab 3 + FSDP2) under torchrun: losses equal lab 1's (and so DDP's); state per rank halves."""

import pytest
import torch

from distlab.infra.experiment import gpt
from distlab.infra.paths import LABS_DIR
from distlab.metrics import read_metrics, read_summary
from support.labs import BASELINE, run_lab, torchrun


@pytest.mark.parametrize("nprocs,micro", [(2, 4), (4, 2)])  # 2 micro-batches per step: no_gradient_sync runs
def test_n_ranks_match_lab_1_and_ddp(nprocs, micro, tmp_path):
    proc = torchrun("lab4_fsdp2.py", nprocs, *BASELINE["args"], "--micro-batch-size", micro, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert losses == pytest.approx(BASELINE["losses"], rel=1e-5)  # lab 2 (DDP) is held to the same list
    summary = read_summary(tmp_path)
    assert summary["world_size"] == nprocs and summary["strategy"].startswith("fsdp2")


def test_state_per_rank_is_at_most_052_of_ddp_and_weights_load_in_lab_1(tmp_path):
    common = ["--steps", "2", "--no-progress", "--sample-chars", "20", "--eval-batches", "1"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    for script, out in [("lab2_ddp.py", ddp), ("lab4_fsdp2.py", fsdp)]:
        proc = torchrun(script, 2, *common, "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ratio = read_summary(fsdp)["state_bytes_per_rank"]["total"] / read_summary(ddp)["state_bytes_per_rank"]["total"]
    assert 0.5 <= ratio <= 0.52
    state = torch.load(fsdp / "model.pt", weights_only=True)  # plain tensors, plain keys
    gpt("tiny", seed=0).load_state_dict(state)
    assert read_summary(fsdp)["sample"]  # rank 0 sampled from the gathered weights


def test_lab4_without_torchrun_is_lab_1(tmp_path):
    proc = run_lab("lab4_fsdp2.py", *BASELINE["args"], "--micro-batch-size", "16", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [m["loss"] for m in read_metrics(tmp_path)] == pytest.approx(BASELINE["losses"], rel=1e-5)


def test_bf16_comes_from_the_fsdp2_policy_alone_and_trains_like_fp32(tmp_path):
    """--dtype bf16: MixedPrecisionPolicy(bf16, reduce fp32), no autocast (one mechanism for labs 4-6)."""
    for lab in ("lab4_fsdp2.py", "lab5_activation_ckpt.py"):
        assert "autocast(" not in (LABS_DIR / lab).read_text(), lab  # no call; comments may say "no autocast"
    args = list(BASELINE["args"])
    args[args.index("--steps") + 1] = "6"  # the baseline's run, its first 6 steps
    proc = torchrun("lab4_fsdp2.py", 2, *args, "--dtype", "bf16", "--micro-batch-size", 4, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    relative = [abs(a - b) / b for a, b in zip(losses, BASELINE["losses"])]
    assert len(losses) == 6 and max(relative) < 1e-3  # bf16 compute: close to fp32's losses ...
    assert max(relative) > 1e-6  # ... and not fp32's (2 fp32 ranks match them to ~1e-7)
    assert read_summary(tmp_path)["dtype"] == "bf16"
