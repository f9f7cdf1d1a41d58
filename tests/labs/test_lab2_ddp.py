"""Labs 2 and 3 under torchrun: N ranks with B/N rows train like lab 1 with B rows."""

import socket

import pytest
import torch

from distlab.infra.labdiff import changed_lines
from distlab.infra.launch import PortInUse, RankFailed, run_script
from distlab.metrics import read_metrics, read_summary
from distlab.model import GPT, preset
from support.labs import BASELINE, run_lab, torchrun


@pytest.mark.parametrize(
    "script,extra",
    [
        ("lab2_ddp.py", []),
        ("lab3_grad_accum.py", ["--micro-batch-size", "4"]),  # 16 / (2 ranks x 4) = 2 micro-batches
        ("lab3_grad_accum.py", ["--micro-batch-size", "2"]),  # 4 micro-batches
    ],
)
def test_two_ranks_match_lab_1(script, extra, tmp_path):
    proc = torchrun(script, 2, *BASELINE["args"], *extra, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert losses == pytest.approx(BASELINE["losses"], rel=1e-5)
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 2
    if "--micro-batch-size" in extra:
        assert summary["accum_steps"] == 16 // (2 * int(extra[1]))


def test_lab2_saves_weights_without_the_module_prefix(tmp_path):
    proc = torchrun("lab2_ddp.py", 2, "--steps", "2", "--no-progress", "--sample-chars", "0", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "model.pt")
    assert not any(k.startswith("module.") for k in state)
    GPT(preset("tiny")).load_state_dict(state)  # loads into the plain model as it is


def test_lab2_without_torchrun_is_lab_1(tmp_path):
    proc = run_lab("lab2_ddp.py", *BASELINE["args"], "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [m["loss"] for m in read_metrics(tmp_path)] == pytest.approx(BASELINE["losses"], rel=1e-5)


@pytest.mark.parametrize(
    "script,args,message",
    [
        ("lab3_grad_accum.py", ["--micro-batch-size", "3"], "is not a multiple of 2 ranks x --micro-batch-size 3"),
        ("lab2_ddp.py", ["--batch-size", "15"], "--batch-size 15 does not split over 2 ranks"),
        ("lab2_ddp.py", ["--batch-size", "1"], "--batch-size 1 does not split over 2 ranks"),  # more ranks than rows
    ],
)
def test_impossible_batches_are_refused_on_every_rank(script, args, message, tmp_path):
    proc = torchrun(script, 2, "--steps", "2", "--out", tmp_path, *args, timeout=120)
    assert proc.returncode != 0
    # both ranks write to one stderr, so their lines may interleave: count, don't split
    assert proc.stderr.count(f"{script}: error: ") == 2, proc.stderr[-2000:]
    assert proc.stderr.count(message) == 2, proc.stderr[-2000:]


def test_a_failing_rank_ends_the_run_with_its_error():
    with pytest.raises(RankFailed, match="does not exist"):
        run_script(
            "src/labs/lab2_ddp.py", ["--steps", "2", "--data", "/no/such/file.txt"], nprocs=2, timeout=120, quiet=True
        )


def test_a_taken_port_is_refused_before_anything_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is already in use"):
            run_script("src/labs/lab2_ddp.py", ["--steps", "2"], nprocs=2, port=port, quiet=True)


def test_lab_diffs_stay_small():
    """Each lab is the previous one plus one feature: the book shows the real diff, which
    must stay readable (STYLE: about 40 changed lines per step)."""
    for old, new in [
        ("lab2_ddp.py", "lab3_grad_accum.py"),
        ("lab3_grad_accum.py", "lab4_fsdp2.py"),
        ("lab4_fsdp2.py", "lab5_activation_ckpt.py"),
    ]:
        removed, added = changed_lines(old, new)
        assert removed + added <= 50, f"{old} -> {new}: {removed} removed, {added} added"
    # lab 2 brings two things lab 1 lacks: DDP, and the checkpoints every later lab resumes from
    removed, added = changed_lines("lab1_single.py", "lab2_ddp.py")
    assert removed + added <= 65, f"lab 1 -> lab 2: {removed} removed, {added} added"
    # lab 6 is lab 5's plumbing rewritten on Accelerate, not one feature more: a bigger diff, but
    # no bigger than lab 5's own distance from lab 1 plus the launcher checks
    removed, added = changed_lines("lab5_activation_ckpt.py", "lab6_accelerate.py")
    assert removed + added <= 120, f"lab 5 -> lab 6: {removed} removed, {added} added"
