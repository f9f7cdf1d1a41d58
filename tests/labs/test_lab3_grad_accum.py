"""Lab 3 under torchrun: micro-batches accumulated on N ranks train like lab 1's whole batch; and the
page's claims: the normaliser for padded micro-batches, no_sync acting through the forward, AdamW and
a missing division by k, exercise 4's checker."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.exercises import check_accumulates_by_tokens
from distlab.exercises.lab3_grad_accum import losses_with_loss_scaled, no_sync_placements, normaliser_errors
from distlab.infra.launch import run_ranks
from distlab.metrics import read_metrics, read_summary
from support.exercises import passes
from support.labs import BASELINE, each_rank, torchrun


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
    ranks = each_rank("lab3_grad_accum.py", 2, "--steps", "2", "--out", tmp_path, "--micro-batch-size", "3")
    for rank, proc in enumerate(ranks):  # each rank's own stderr, read after both exited
        assert proc.returncode == 1, (rank, proc.stderr[-2000:])
        assert proc.stderr.startswith("lab3_grad_accum.py: error: "), (rank, proc.stderr[-2000:])
        assert "is not a multiple of 2 ranks x --micro-batch-size 3" in proc.stderr, (rank, proc.stderr[-2000:])


# --- padded micro-batches, no_sync's forward, the missing division (the lab 3 page's claims) ---


def test_only_the_global_token_count_gives_the_one_process_gradient():
    ranks = run_ranks(normaliser_errors, nprocs=2, args=(2,), quiet=True)
    assert ranks[0]["tokens"] != ranks[1]["tokens"]  # the micro-batches' counts differ, as the claim needs
    for rank in ranks:
        errors = rank["errors"]
        assert errors["global_tokens"] < 1e-5, errors  # rounding: the one-process gradient
        assert errors["mean_of_means"] > 1e-2 and errors["rank_tokens"] > 1e-2, errors


def test_no_sync_acts_through_the_forward_not_the_backward():
    for counts in run_ranks(no_sync_placements, nprocs=2, quiet=True):
        # (forward inside, backward inside) -> (bucket all-reduces in that backward, in the last one)
        assert counts == {(True, True): (0, 1), (True, False): (0, 1), (False, True): (1, 1), (False, False): (1, 1)}


def largest_relative_difference(optimizer: str, max_norm: float) -> float:
    once, k_times = (losses_with_loss_scaled(optimizer, scale, max_norm)["losses"] for scale in (1, 4))
    return max(abs(a - b) / a for a, b in zip(once, k_times))


def test_adamw_ignores_a_constant_loss_scale_but_sgd_and_clipping_do_not():
    adamw = largest_relative_difference("adamw", 0.0)
    assert adamw < 1e-5  # only epsilon sees the scale
    assert largest_relative_difference("sgd", 0.0) > 1e-2  # a 4x learning rate
    # clipped at 5: only the x4 run clips, so AdamW sees a scale that changes from step to step
    once, k_times = (losses_with_loss_scaled("adamw", scale, 5.0)["clipped_steps"] for scale in (1, 4))
    assert once == 0 < k_times
    assert largest_relative_difference("adamw", 5.0) > 100 * adamw


def accumulate_by_tokens(model, micro_batches):
    tokens = torch.tensor(sum(int((y != -100).sum()) for _, y in micro_batches))
    dist.all_reduce(tokens)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            logits, _ = model(x)
            summed = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            (summed * dist.get_world_size() / tokens).backward()


def accumulate_as_lab_3(model, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            _, loss = model(x, y)
            (loss / len(micro_batches)).backward()


def accumulate_with_the_forward_outside(model, micro_batches):
    tokens = torch.tensor(sum(int((y != -100).sum()) for _, y in micro_batches))
    dist.all_reduce(tokens)
    for i, (x, y) in enumerate(micro_batches):
        logits, _ = model(x)  # outside no_sync: this backward all-reduces whatever the context
        summed = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            (summed * dist.get_world_size() / tokens).backward()


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_token_checker_passes_the_answer_and_names_the_mistakes(capsys):
    assert "1 bucket all-reduce(s)" in passes(check_accumulates_by_tokens, accumulate_by_tokens, capsys=capsys)
    with pytest.raises(AssertionError, match=r"differs from the one-process mean .* divided by k \(lab 3's"):
        check_accumulates_by_tokens(accumulate_as_lab_3)
    with pytest.raises(AssertionError, match=r"reduced 3 buckets, one backward's worth is 1: is every forward"):
        check_accumulates_by_tokens(accumulate_with_the_forward_outside)
