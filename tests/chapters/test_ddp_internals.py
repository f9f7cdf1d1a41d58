"""The from-scratch DDP wrappers against torch's DDP and against one process, on what
the page does not run: 4 ranks, BucketedDDP's layout, rank 0's weights, the compile
order the page skips, and the edge-case models. The page checks its own launches on
every build (the wrappers' gradients and losses on 2 ranks, the division on 3, the
Reducer's buckets, gradient_as_bucket_view, an unused parameter reported)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.chapters.ddp_internals import FROM_SCRATCH, train_steps
from distlab.infra.launch import run_ranks
from distlab.model import GPT, preset
from distlab.scratch.ddp import BucketedDDP, NaiveDDP
from support.edge_models import (
    EDGE_MODELS,
    NEEDS_UNUSED_SEARCH,
    assert_same_grads,
    reference,
    shard,
    train_wrapped,
)

SMALL_BUCKETS_MB = 0.05  # several buckets even for the tiny model


def all_losses():
    # single inside a process group is still one process's run: the whole batch,
    # no all-reduce
    return {
        s: train_steps(s, steps=10)["losses"] for s in ("single", "ddp", *FROM_SCRATCH)
    }


@pytest.fixture(scope="module")
def single_process_losses():
    return train_steps("single", steps=10)["losses"]


@pytest.mark.parametrize("nprocs", [4])  # the page checks 2 ranks on every build
def test_n_ranks_train_like_one_process(nprocs, single_process_losses):
    """N ranks x B/N rows vs 1 process x B rows: the same losses for 10 steps, 1e-5
    relative (the harness's ``single`` against ``ddp`` and each from-scratch DDP)."""
    per_rank = run_ranks(all_losses, nprocs=nprocs, quiet=True, timeout=300)
    # every rank logs the same global loss
    assert all(r == per_rank[0] for r in per_rank)
    assert list(per_rank[0]) == [
        "single",
        "ddp",
        "ddp-naive",
        "ddp-hooks",
        "ddp-bucketed",
    ]
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


def test_ranks_start_from_rank_0_weights():
    def weights_after_wrap():
        torch.manual_seed(dist.get_rank())  # deliberately different weights per rank
        model = NaiveDDP(nn.Linear(3, 3))
        return model.module.weight.detach().clone()

    w0, w1 = run_ranks(weights_after_wrap, nprocs=2, quiet=True)
    assert torch.equal(w0, w1)


# ---- what torch's DDP really does under torch.compile: the page runs
# torch.compile(DDP(model)) on every build; here the other order and the tiny model


def compile_runs():
    from distlab.chapters.ddp_internals import compiled_ddp

    return {
        "tiny": compiled_ddp(),
        "wide, compiled first": compiled_ddp(n_embd=256, compile_first=True),
    }


def test_ddp_optimizer_splits_the_compiled_graph_where_ddp_bucket_sizes_fall_in_either_order():  # noqa: E501
    runs = run_ranks(compile_runs, nprocs=2, quiet=True, timeout=600)[0]
    assert runs["tiny"]["graphs"] == 1  # 0.41 MiB: all in the first 1 MiB
    wide = runs["wide, compiled first"]  # DDP(torch.compile(model)) is split too
    assert (
        wide["graphs"] == 2 == len(wide["ddp_buckets"])
        and "created 2 buckets" in wide["ddp_optimizer"][0]
    )


# ---- models that break wrappers written for one model (tests/support/edge_models.py)


@pytest.fixture(scope="module", params=[2, 3])
def edge_cases(request):
    def edge_case_runs():
        """On each rank: torch DDP and every from-scratch wrapper on every edge-case
        model, then the unused-parameter model under torch DDP and BucketedDDP without
        the flag that admits it, and BucketedDDP given two backwards before one sync."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        from distlab.scratch.ddp import HookDDP

        runs, errors = {}, {}
        for name in EDGE_MODELS:
            search = name in NEEDS_UNUSED_SEARCH
            wrappers = {
                "ddp": lambda m, s=search: DDP(m, find_unused_parameters=s),
                "ddp-naive": NaiveDDP,
                # not on "data-dependent": its docstring says why it cannot
                "ddp-hooks": HookDDP,
                "ddp-bucketed": lambda m, s=search: BucketedDDP(
                    m, bucket_cap_mb=1e-6, find_unused_parameters=s
                ),
                "ddp-one-bucket": lambda m, s=search: BucketedDDP(
                    m, find_unused_parameters=s
                ),
            }
            for wrapper, wrap in wrappers.items():
                if (name, wrapper) != ("data-dependent", "ddp-hooks"):
                    runs[name, wrapper] = train_wrapped(wrap, name)
        for wrapper, wrap in {"ddp": DDP, "ddp-bucketed": BucketedDDP}.items():
            try:
                train_wrapped(wrap, "unused")
            except RuntimeError as err:
                errors[wrapper] = str(err)
        try:  # last: it leaves a bucket's all-reduce behind
            train_wrapped(BucketedDDP, "tied", backwards_per_step=2)
        except RuntimeError as err:
            errors["two backwards"] = str(err)
        return runs, errors

    return request.param, run_ranks(
        edge_case_runs, nprocs=request.param, quiet=True, timeout=300
    )


def test_every_wrapper_handles_frozen_unused_tied_and_buffers_like_torch_ddp(
    edge_cases,
):
    """Per step, each rank's gradients (None where torch DDP leaves None) equal one
    process's on the same shards and torch DDP's; the buffers each rank ends with equal
    torch DDP's there."""
    world_size, per_rank = edge_cases
    # "extra" runs on even ranks only
    assert shard(1, world_size, 0).mean() < 0 < shard(0, world_size, 0).mean()
    runs = per_rank[0][0]
    assert {w for _, w in runs} == {
        "ddp",
        "ddp-naive",
        "ddp-hooks",
        "ddp-bucketed",
        "ddp-one-bucket",
    }
    for name, wrapper in runs:
        one_process = reference(name, world_size)
        for rank, (rank_runs, _) in enumerate(per_rank):
            got, torch_ddp, what = (
                rank_runs[name, wrapper],
                rank_runs[name, "ddp"],
                f"{wrapper} {name} rank {rank}",
            )
            assert_same_grads(got["grads"], one_process["grads"], what=what)
            assert_same_grads(got["grads"], torch_ddp["grads"], what=what)
            for mine, theirs in zip(got["params"], one_process["params"], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=what)
            for mine, theirs in zip(got["buffers"], torch_ddp["buffers"], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=what)


def test_without_find_unused_parameters_torch_ddp_and_bucketed_ddp_both_refuse(
    edge_cases,
):
    _, per_rank = edge_cases
    for _, errors in per_rank:
        assert (
            "Expected to have finished reduction in the prior iteration"
            in errors["ddp"]
        )
        assert "find_unused_parameters=True" in errors["ddp"]
        assert "torch DDP stops too" in errors["ddp-bucketed"]
        assert "find_unused_parameters=True" in errors["ddp-bucketed"]
        assert "arrived twice before finish_gradient_sync()" in errors["two backwards"]
