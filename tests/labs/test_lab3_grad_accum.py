"""Lab 3 under torchrun: micro-batches accumulated on N ranks train like lab 1's whole batch."""

import pytest

from distlab.metrics import read_metrics, read_summary
from support.labs import BASELINE, torchrun


@pytest.mark.parametrize("micro_batch_size", [4, 2])  # 16 rows / (2 ranks x 4) = 2 micro-batches; x 2 = 4
def test_two_ranks_accumulating_match_lab_1(micro_batch_size, tmp_path):
    proc = torchrun(
        "lab3_grad_accum.py", 2, *BASELINE["args"], "--micro-batch-size", micro_batch_size, "--out", tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert losses == pytest.approx(BASELINE["losses"], rel=1e-5)
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 2
    assert summary["accum_steps"] == 16 // (2 * micro_batch_size)


def test_a_batch_that_does_not_split_into_micro_batches_is_refused_on_every_rank(tmp_path):
    proc = torchrun("lab3_grad_accum.py", 2, "--steps", "2", "--out", tmp_path, "--micro-batch-size", "3", timeout=120)
    assert proc.returncode != 0
    # both ranks write to one stderr, so their lines may interleave: count, don't split
    assert proc.stderr.count("lab3_grad_accum.py: error: ") == 2, proc.stderr[-2000:]
    assert proc.stderr.count("is not a multiple of 2 ranks x --micro-batch-size 3") == 2, proc.stderr[-2000:]
