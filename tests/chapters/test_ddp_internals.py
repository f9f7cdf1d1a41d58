"""The from-scratch DDP wrappers against torch's DDP and against one process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.chapters.ddp_internals import FROM_SCRATCH, gradients, train_steps
from distlab.infra.launch import RankFailed, run_ranks
from distlab.model import GPT, preset
from distlab.scratch.ddp import BucketedDDP, NaiveDDP
from support.edge_models import EDGE_MODELS, NEEDS_UNUSED_SEARCH, assert_same_grads, reference, shard, train_wrapped

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


# ---- what torch's DDP really does (the page's "What the real Reducer does" and "knobs" sections)


def reducer_facts():
    from distlab.chapters.ddp_internals import bucket_layouts, gradient_when_backward_returns

    return {
        "small": bucket_layouts("tiny", SMALL_BUCKETS_MB),
        "unused": bucket_layouts("tiny", SMALL_BUCKETS_MB, find_unused_parameters=True),
        "default": bucket_layouts("shakespeare"),
        "backward": gradient_when_backward_returns(),
    }


def test_reducer_uses_one_bucket_first_then_rebuilds_once_in_gradient_ready_order():
    per_rank = run_ranks(reducer_facts, nprocs=2, quiet=True, timeout=300)
    facts = per_rank[0]
    assert per_rank[1]["small"]["layouts"] == facts["small"]["layouts"]  # rank 0's layout, everywhere
    for setting in ("small", "default"):
        layouts, names = facts[setting]["layouts"], facts[setting]["parameters"]
        assert layouts["built"] == layouts["after backward 1"] and len(layouts["built"]) == 1
        assert layouts["built"][0][1] == names  # all of them, in parameters() order, whatever the cap
        rebuilt = layouts["from forward 2 on"]
        assert [n for _, ns in rebuilt for n in ns] == facts[setting]["ready_order"] != names[::-1]
    small = [size for size, _ in facts["small"]["layouts"]["from forward 2 on"]]
    assert len(small) > 3 and all(size >= SMALL_BUCKETS_MB * 2**20 for size in small[:-1])  # cap passed: first too
    sizes = [size for size, _ in facts["default"]["layouts"]["from forward 2 on"]]
    largest = max(facts["default"]["bytes"].values())
    assert len(sizes) == 3 and 2**20 <= sizes[0] < 2**20 + largest and 25 * 2**20 <= sizes[1] < 25 * 2**20 + largest
    unused = facts["unused"]["layouts"]  # find_unused_parameters=True: cut by size at once, never rebuilt
    assert len(unused["built"]) > 1 and unused["built"] == unused["from forward 2 on"]
    # backward() itself waits: the mean is in .grad when it returns, with no call after it
    inside = [r["backward"]["inside backward"] for r in per_rank]
    assert not torch.equal(*inside)
    for r in per_rank:
        assert torch.equal(r["backward"]["after backward"], (inside[0] + inside[1]) / 2)


def test_ddp_divides_before_the_sum_which_rounds_differently_from_after_on_3_ranks():
    from distlab.chapters.ddp_internals import predivision, ulps_of_largest

    three = run_ranks(predivision, nprocs=3, quiet=True, timeout=300)[0]
    assert three["factors"] == [1 / 3]  # the Reducer's aten.mul.out into the bucket
    assert any((a != b).any() for a, b in zip(three["ddp"], three["naive"]))  # not bit-identical
    assert 0 < ulps_of_largest(three["ddp"], three["naive"]) <= 4  # the page's stated tolerance
    assert ulps_of_largest(three["naive_predivided"], three["naive"]) > 0  # the placement alone differs


def bucket_view_runs():
    from distlab.chapters.ddp_internals import bucket_view_costs

    return {
        (tokens, view, to_none): bucket_view_costs(view, to_none, *((4, 64) if tokens == "many" else (1, 8)))
        for tokens in ("many", "few")
        for view in (False, True)
        for to_none in (True, False)
    }


def test_gradient_as_bucket_view_saves_copies_always_and_memory_only_when_grads_exist_at_the_peak():
    runs = run_ranks(bucket_view_runs, nprocs=2, quiet=True, timeout=300)[0]
    n = len(list(GPT(preset("tiny")).parameters()))
    grad_bytes = sum(p.numel() * 4 for p in GPT(preset("tiny")).parameters())
    ops = ("copies into the bucket (x 1/N)", "copies back to .grad", "in-place divisions in the bucket")
    expected = {(False, True): (n, n, 0), (False, False): (n, n, 0), (True, True): (n, 0, 0), (True, False): (0, 0, n)}
    for (_, view, to_none), r in runs.items():
        assert tuple(r[op] for op in ops) == expected[view, to_none]
        assert r["gradient storages"] == (1 if view else n)

    def saved(tokens, to_none):
        return runs[tokens, False, to_none]["peak_bytes"] - runs[tokens, True, to_none]["peak_bytes"]

    assert abs(saved("many", True)) < grad_bytes / 10  # peak while activations live, no gradient yet
    for tokens, to_none in (("many", False), ("few", True), ("few", False)):
        assert saved(tokens, to_none) == pytest.approx(grad_bytes, rel=0.1)


def compile_runs():
    from distlab.chapters.ddp_internals import compiled_ddp

    return {"tiny": compiled_ddp(), "wide, compiled first": compiled_ddp(n_embd=256, compile_first=True)}


def test_ddp_optimizer_splits_the_compiled_graph_where_ddp_bucket_sizes_fall_in_either_order():
    runs = run_ranks(compile_runs, nprocs=2, quiet=True, timeout=600)[0]
    assert runs["tiny"]["graphs"] == 1  # 0.41 MiB: all in the first 1 MiB
    wide = runs["wide, compiled first"]  # DDP(torch.compile(model)) is split too
    assert wide["graphs"] == 2 == len(wide["ddp_buckets"]) and "created 2 buckets" in wide["ddp_optimizer"][0]


# ---- models that break wrappers written for one model (tests/support/edge_models.py)


@pytest.fixture(scope="module", params=[2, 3])
def edge_cases(request):
    def edge_case_runs():
        """On each rank: torch DDP and every from-scratch wrapper on every edge-case model, then
        the unused-parameter model under torch DDP and BucketedDDP without the flag that admits it,
        and BucketedDDP given two backwards before one sync."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        from distlab.scratch.ddp import HookDDP

        runs, errors = {}, {}
        for name in EDGE_MODELS:
            search = name in NEEDS_UNUSED_SEARCH
            wrappers = {
                "ddp": lambda m, s=search: DDP(m, find_unused_parameters=s),
                "ddp-naive": NaiveDDP,
                "ddp-hooks": HookDDP,  # not on "data-dependent": its docstring says why it cannot
                "ddp-bucketed": lambda m, s=search: BucketedDDP(m, bucket_cap_mb=1e-6, find_unused_parameters=s),
                "ddp-one-bucket": lambda m, s=search: BucketedDDP(m, find_unused_parameters=s),
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

    return request.param, run_ranks(edge_case_runs, nprocs=request.param, quiet=True, timeout=300)


def test_every_wrapper_handles_frozen_unused_tied_and_buffers_like_torch_ddp(edge_cases):
    """Per step, each rank's gradients (None where torch DDP leaves None) equal one process's on
    the same shards and torch DDP's; the buffers each rank ends with equal torch DDP's there."""
    world_size, per_rank = edge_cases
    assert shard(1, world_size, 0).mean() < 0 < shard(0, world_size, 0).mean()  # "extra" runs on even ranks only
    runs = per_rank[0][0]
    assert {w for _, w in runs} == {"ddp", "ddp-naive", "ddp-hooks", "ddp-bucketed", "ddp-one-bucket"}
    for name, wrapper in runs:
        one_process = reference(name, world_size)
        for rank, (rank_runs, _) in enumerate(per_rank):
            got, torch_ddp, what = rank_runs[name, wrapper], rank_runs[name, "ddp"], f"{wrapper} {name} rank {rank}"
            assert_same_grads(got["grads"], one_process["grads"], what=what)
            assert_same_grads(got["grads"], torch_ddp["grads"], what=what)
            for mine, theirs in zip(got["params"], one_process["params"], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=what)
            for mine, theirs in zip(got["buffers"], torch_ddp["buffers"], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=what)


def test_without_find_unused_parameters_torch_ddp_and_bucketed_ddp_both_refuse(edge_cases):
    _, per_rank = edge_cases
    for _, errors in per_rank:
        assert "Expected to have finished reduction in the prior iteration" in errors["ddp"]
        assert "find_unused_parameters=True" in errors["ddp"]
        assert "torch DDP stops too" in errors["ddp-bucketed"]
        assert "find_unused_parameters=True" in errors["ddp-bucketed"]
        assert "arrived twice before finish_gradient_sync()" in errors["two backwards"]
