"""The from-scratch DDP wrappers against torch's DDP and against one process, on what
the page does not run: 4 ranks, BucketedDDP's layout, a model that mixes dtypes, rank
0's weights, the compile order the page skips, and the edge-case models. The page
checks its own launches on every build (the wrappers' gradients and losses on 2 ranks,
the division on 3, the Reducer's buckets, gradient_as_bucket_view, an unused parameter
reported)."""

import copy

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


@pytest.mark.parametrize("seed", range(4))
def test_assign_buckets_cuts_as_torchs_assignment_function(seed):
    """Random tensors of three dtypes, in the order backward would finish them: the
    same buckets as torch's compute_bucket_assignment_by_size in the Reducer's rebuild
    mode (tensor indices given: no sorting), in the same order but for the buckets
    still filling at the end, which torch lists in its hash map's order."""
    from distlab.scratch.ddp import assign_buckets  # new with the dtype rule

    gen = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    params = [
        torch.empty(
            int(torch.randint(1, 3000, (), generator=gen)),
            dtype=dtypes[int(torch.randint(0, 3, (), generator=gen))],
        )
        for _ in range(40)
    ]
    index = {id(p): i for i, p in enumerate(params)}
    ours = [[index[id(p)] for p in b] for b in assign_buckets(params, 4000, 10000)]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        params, [4000, 10000], [], list(range(len(params)))
    )
    assert sorted(ours) == sorted(theirs)
    assert ours[: -len(dtypes)] == theirs[: -len(dtypes)]  # at most 3 still filling
    assert all(len({params[i].dtype for i in b}) == 1 for b in ours)


class Fp32BodyBf16Head(nn.Module):
    """An fp32 body and a bf16 head (4 and 3 square layers, no biases, so backward
    finishes the weights in exactly the reverse of ``parameters()``, the order
    BucketedDDP assumes and torch's Reducer measures)."""

    def __init__(self, width: int = 64):
        super().__init__()
        layers = [nn.Linear(width, width, bias=False) for _ in range(7)]
        self.body = nn.Sequential(*layers[:4])
        self.head = nn.Sequential(*layers[4:]).to(torch.bfloat16)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).to(torch.bfloat16)).float()


# 12 KiB: one fp32 layer (16 KiB) closes a bucket, two bf16 ones (8 KiB each) do, and
# the last bf16 layer is left over; reversed, the old one-dtype-per-first-parameter
# layout put the first fp32 gradient in a bf16 bucket
MIXED_CAP_MB = 12 / 1024


def mixed_dtype_runs():
    """On each rank: BucketedDDP and torch DDP (same caps) on copies of the mixed-dtype
    model, two steps; whether each step's gradients are equal, and the three layouts
    as parameter indices: ours, torch's Reducer after its rebuild, and torch's
    assignment function on the order the first backward made the gradients ready."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Fp32BodyBf16Head()
    ours = BucketedDDP(copy.deepcopy(model), bucket_cap_mb=MIXED_CAP_MB)
    theirs = DDP(copy.deepcopy(model), bucket_cap_mb=MIXED_CAP_MB)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    equal = []
    for _ in range(2):
        for wrapped in (ours, theirs):
            wrapped.module.zero_grad(set_to_none=True)
            wrapped(x).pow(2).mean().backward()
        ours.finish_gradient_sync()
        equal.append(
            [
                torch.equal(a.grad, b.grad)
                for a, b in zip(ours.module.parameters(), theirs.module.parameters())
            ]
        )
    index = {p: i for i, p in enumerate(ours.module.parameters())}
    torch_index = {id(p): i for i, p in enumerate(theirs.module.parameters())}
    ready = theirs._get_ddp_logging_data()["prev_iteration_grad_ready_order_indices"]
    ready = [int(i) for i in ready.split(",")]
    params = list(theirs.module.parameters())
    assignment, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in ready], [int(MIXED_CAP_MB * 2**20)] * 2, [], ready
    )
    return {
        "equal": equal,
        "ready": ready,
        "ours": [[index[p] for p in b.params] for b in ours.buckets],
        "dtypes": [str(b.buffer.dtype) for b in ours.buckets],
        "torch reducer": [
            [torch_index[id(p)] for p in b.parameters()]
            for b in theirs.reducer._get_zeros_like_grad_buckets()
        ],
        "torch assignment": assignment,
    }


def test_bucketed_ddp_buckets_by_dtype_like_torch_ddp():
    """fp32 body, bf16 head on 2 ranks: BucketedDDP keeps one dtype per bucket, as torch
    does, so its gradients equal torch DDP's bit for bit and its buckets are torch's
    (an fp32 gradient in a bf16 bucket would be rounded)."""
    per_rank = run_ranks(mixed_dtype_runs, nprocs=2, quiet=True)
    for run in per_rank:
        # per step and parameter (the old layout rounded body.3's fp32 gradient in a
        # bf16 bucket)
        assert all(all(step) for step in run["equal"]), run["equal"]
        assert run["ready"] == [6, 5, 4, 3, 2, 1, 0]  # the order BucketedDDP assumes
        assert run["ours"] == run["torch reducer"] == run["torch assignment"]
        assert run["ours"] == [[6, 5], [3], [2], [1], [0], [4]]
        assert run["dtypes"] == [
            "torch.bfloat16",
            *["torch.float32"] * 4,
            "torch.bfloat16",
        ]


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
