"""The from-scratch DDP wrappers against torch's DDP and against one process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.chapters.ddp_internals import FROM_SCRATCH, gradients, train_steps
from distlab.infra.launch import RankFailed, run_ranks
from distlab.model import GPT, preset
from distlab.scratch.ddp import BucketedDDP, NaiveDDP

SMALL_BUCKETS_MB = 0.05  # several buckets even for the tiny model


def all_gradients():
    """On each rank: torch DDP's gradients and each from-scratch wrapper's."""
    return {s: gradients(s, bucket_cap_mb=SMALL_BUCKETS_MB) for s in ("ddp", *FROM_SCRATCH)}


def all_losses():
    # single inside a process group is still one process's run: the whole batch, no all-reduce
    return {s: train_steps(s, steps=10)["losses"] for s in ("single", "ddp", *FROM_SCRATCH)}


@pytest.fixture(scope="module")
def single_process_losses():
    return train_steps("single", steps=10)["losses"]


def test_from_scratch_gradients_equal_torch_ddp_on_every_rank():
    for rank_result in run_ranks(all_gradients, nprocs=2, quiet=True):
        reference = rank_result["ddp"]
        for strategy in FROM_SCRATCH:
            for ours, theirs in zip(rank_result[strategy], reference):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_n_ranks_train_like_one_process(nprocs, single_process_losses):
    """N ranks x B/N rows vs 1 process x B rows: the same losses for 10 steps, 1e-5 relative
    (the harness's ``single`` against ``ddp`` and each from-scratch DDP)."""
    per_rank = run_ranks(all_losses, nprocs=nprocs, quiet=True, timeout=300)
    assert all(r == per_rank[0] for r in per_rank)  # every rank logs the same global loss
    assert list(per_rank[0]) == ["single", "ddp", "ddp-naive", "ddp-hooks", "ddp-bucketed"]
    for strategy, losses in per_rank[0].items():
        assert losses == pytest.approx(single_process_losses, rel=1e-5), strategy


def test_buckets_follow_reverse_parameter_order_and_respect_the_cap():
    def layout():
        model = BucketedDDP(GPT(preset("tiny")), bucket_cap_mb=SMALL_BUCKETS_MB)
        order = [p for b in model.buckets for p in b.params]
        cap = SMALL_BUCKETS_MB * 2**20
        return (
            order == list(reversed(list(model.module.parameters()))),
            [sum(p.numel() * 4 for p in b.params[:-1]) < cap for b in model.buckets],
            len(model.buckets),
        )

    in_order, under_cap, n_buckets = run_ranks(layout, nprocs=1, quiet=True)[0]
    assert in_order and all(under_cap) and n_buckets > 1


def test_an_unused_parameter_is_reported_not_hung():
    def unused_parameter():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        wrapped = BucketedDDP(model, bucket_cap_mb=1e-6)  # one bucket per parameter
        model[0](torch.randn(2, 4)).sum().backward()  # model[1] is never used
        wrapped.finish_gradient_sync()

    with pytest.raises(RankFailed, match="find_unused_parameters"):
        run_ranks(unused_parameter, nprocs=2, quiet=True)


def test_ranks_start_from_rank_0_weights():
    def weights_after_wrap():
        torch.manual_seed(dist.get_rank())  # deliberately different weights per rank
        model = NaiveDDP(nn.Linear(3, 3))
        return model.module.weight.detach().clone()

    w0, w1 = run_ranks(weights_after_wrap, nprocs=2, quiet=True)
    assert torch.equal(w0, w1)
