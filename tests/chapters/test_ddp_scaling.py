"""The DDP step model: its pure functions, its buckets against DDP's rule, its
prediction for the recorded 1/2/4-rank runs on fixed inputs; the all-reduce cost models;
and the halving-doubling all-reduce against dist.all_reduce. The page runs the check
against this machine on every build (torch DDP's real buckets, the alpha-beta fit, the
exposed all-reduce) and asserts what does not depend on the machine's load."""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.bench import backward_ready
from distlab.chapters.ddp_scaling import (
    BACKWARD_READY,
    GPT2_SMALL,
    GPU_FLOPS,
    RECORDED,
    recorded_runs_check,
)
from distlab.costs import collectives as costs
from distlab.errors import UserError
from distlab.flops import flops_per_token
from distlab.infra.launch import run_ranks
from distlab.model import preset
from distlab.scratch import halving_doubling
from distlab.tools.step_model import (
    GPU_LINKS,
    Link,
    backward_done,
    bucket_ready,
    bucket_sizes,
    ddp_default_buckets,
    ddp_schedule,
    ddp_step,
    efficiency,
    gradient_bytes,
    link_from_nccl_tests,
    ring_all_reduce_s,
    smallest_batch,
    smallest_batch_from_nccl_tests,
)

FAST = Link("test", alpha=1e-6, busbw=100e9, source="test")


def test_ring_time_is_the_alpha_beta_model_of_the_collectives_page():
    assert ring_all_reduce_s(10**9, 1, FAST) == 0
    assert ring_all_reduce_s(8e6, 4, FAST) == pytest.approx(
        6 * 1e-6 + 1.5 * 8e6 / 100e9
    )
    # NCCL's per-call latency is paid once; a Link without it is the planner's
    based = Link("based", alpha=1e-6, busbw=100e9, source="test", base=5e-6)
    assert ring_all_reduce_s(8e6, 4, based) == pytest.approx(
        ring_all_reduce_s(8e6, 4, FAST) + 5e-6
    )


def test_buckets_follow_ddps_rule_whole_tensors_in_reverse_order():
    grads = gradient_bytes(preset("shakespeare"))
    assert sum(grads) == 4 * 10_770_816
    default = ddp_default_buckets(preset("shakespeare"))
    # torch DDP's, read on the page
    assert sum(default) == sum(grads) and default == [2363904, 28391424, 12327936]
    # closes at the first tensor that reaches the cap
    assert bucket_sizes([5, 5, 5], cap_bytes=8) == [10, 5]
    assert bucket_sizes([5, 5, 5], cap_bytes=100) == [15]


def test_step_exposes_the_last_bucket_on_fast_links_and_everything_without_overlap():
    buckets = [10e6, 10e6, 10e6]
    cost = ring_all_reduce_s(10e6, 8, FAST)
    # 1 s of compute hides all but the last bucket
    fast = ddp_step(1.0, buckets, 8, FAST)
    assert fast["exposed"] == pytest.approx(cost) and fast["comm"] == pytest.approx(
        3 * cost
    )
    serial = ddp_step(1.0, buckets, 8, FAST, overlap=False)
    assert serial["exposed"] == pytest.approx(3 * cost)
    slow = ddp_step(1e-6, buckets, 8, FAST)  # no compute to hide behind
    assert (
        slow["exposed"] == pytest.approx(3 * cost, rel=1e-3)
        and slow["efficiency"] < 0.01
    )


def test_backward_spreads_its_time_by_flops_and_completes_the_tied_embedding_last():
    cfg = GPT2_SMALL
    done = backward_done(cfg)
    assert done == sorted(done) and done[-1] == 1.0
    # the fractions are of backward's FLOPs: 2/3 of flops_per_token
    backward = 2 * flops_per_token(cfg) / 3
    head = 4 * cfg.vocab_size * cfg.n_embd  # the tied head's backward, first
    assert done[0] == pytest.approx(head / backward)
    # the embedding's own lookup costs nothing: the two before it end where it does
    assert done[-2] == done[-3] == pytest.approx(1.0)
    buckets, ready = ddp_schedule(cfg)
    assert buckets == ddp_default_buckets(cfg) and len(ready) == len(buckets)
    assert ready == sorted(ready) and ready[-1] == 1.0 and ready[0] > head / backward
    # a cap passed caps the first bucket too
    capped, _ = ddp_schedule(cfg, 25 * 2**20)
    assert capped == bucket_sizes(gradient_bytes(cfg), 25 * 2**20)
    assert capped[0] > buckets[0]
    assert bucket_ready([1, 1, 1, 1], [0.25, 0.5, 0.75, 1.0], [2, 2]) == [0.5, 1.0]


def test_smallest_batch_is_the_first_to_reach_the_target():
    cfg, link = GPT2_SMALL, GPU_LINKS["100 Gb/s network"]
    b = smallest_batch(cfg, 8, link, GPU_FLOPS)
    assert (
        efficiency(cfg, b, 8, link, GPU_FLOPS)
        >= 0.9
        > efficiency(cfg, b - 1, 8, link, GPU_FLOPS)
    )
    faster = smallest_batch(cfg, 8, GPU_LINKS["NVLink (one node)"], GPU_FLOPS)
    assert faster < b
    with pytest.raises(UserError):
        smallest_batch(cfg, 8, link, GPU_FLOPS, target=1.5)


def test_a_link_fitted_to_nccl_tests_rows_at_bucket_sizes_gives_the_same_answer():
    cfg, link = GPT2_SMALL, GPU_LINKS["400 Gb/s network"]
    # all_reduce_perf rows as the model's own ring would print them, 8 B .. 1 GiB; the
    # rows outside 1-64 MiB are made wrong on purpose: the fit must not read them
    rows = [(2**k, ring_all_reduce_s(2**k, 8, link) * 1e6) for k in range(20, 27)]
    rows += [(8, 1.0), (2**30, 1.0)]
    fitted = link_from_nccl_tests(rows, 8)
    assert fitted.busbw == pytest.approx(link.busbw)
    assert fitted.base == pytest.approx(ring_all_reduce_s(0, 8, link))
    b = smallest_batch(cfg, 8, link, GPU_FLOPS)
    assert smallest_batch_from_nccl_tests(cfg, 8, rows, GPU_FLOPS) == b
    with pytest.raises(UserError, match="-b 1M -e 64M"):
        link_from_nccl_tests([(8, 20.0), (2**30, 9000.0)], 8)
    with pytest.raises(UserError, match="does not grow"):
        link_from_nccl_tests([(2**20, 50.0), (2**21, 40.0)], 8)


def test_all_reduce_cost_models():
    a, bw = 5e-6, 50e9
    assert costs.halving_doubling_s(1e6, 2, a, bw) == pytest.approx(
        costs.ring_s(1e6, 2, a, bw)
    )
    # NCCL's tree: a chain of g GPUs in the node, log2 M network hops each way
    tree = costs.tree_s(0, 8, 8, (1e-6, bw), (a, bw), base=2e-6)
    assert tree == pytest.approx(2e-6 + 2 * (7 * 1e-6 + 3 * a))
    # across 64 nodes of one GPU its log2 latency wins small messages
    assert costs.tree_s(1e3, 64, 1, (a, bw), (a, bw)) < costs.ring_s(1e3, 64, a, bw)
    big = 1e10
    assert costs.in_network_s(big, a, bw) / costs.ring_s(
        big, 64, a, bw
    ) == pytest.approx(64 / 126, rel=1e-2)
    one_node = costs.hierarchical_s(1e6, 1, 8, (a, bw), (a, bw))
    # reduce-scatter + all-gather is the ring
    assert one_node == pytest.approx(costs.ring_s(1e6, 8, a, bw))
    # NCCL's latencies for one H100 node: 8.4 + 14 x 3.4 us (ring), 8.4 + 2 x 7 x 4.0
    # (the chain), a flat 25 (NVLS), 6.6 + 14 x 0.6 (ring, LL)
    zero = costs.algorithms_one_node(0)
    assert zero["ring"] == pytest.approx(56.0e-6)
    assert zero["tree (a chain)"] == pytest.approx(64.4e-6)
    assert zero["NVLS (switch sums)"] == pytest.approx(25e-6)
    assert zero["ring, LL"] == pytest.approx(15e-6)


def _against_all_reduce() -> list:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    out = []
    for numel in (n - 1, 8, 1001, 100_003):
        i = torch.randint(-100, 100, (numel,))
        x = torch.randn(numel)
        i_ref, x_ref = i.clone(), x.clone()
        dist.all_reduce(i_ref), dist.all_reduce(x_ref)
        sent = []
        halving_doubling.halving_doubling_all_reduce(i, sent)
        halving_doubling.halving_doubling_all_reduce(x)
        out.append(
            (
                numel,
                torch.equal(i, i_ref),
                (x - x_ref).abs().max().item(),
                len(sent),
                sum(sent),
            )
        )
    t = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # non-contiguous
    halving_doubling.halving_doubling_all_reduce(t)
    out.append(torch.equal(t, torch.arange(12.0).reshape(3, 4).t() * n * (n + 1) / 2))
    return out


def test_halving_doubling_equals_dist_all_reduce_in_2_log2_n_messages():
    n = 4
    for per_rank in run_ranks(_against_all_reduce, nprocs=n, quiet=True, timeout=60):
        *cases, non_contiguous = per_rank
        assert non_contiguous
        for numel, ints_equal, worst, messages, elements in cases:
            assert ints_equal and worst < 1e-4
            assert messages == 2 * math.log2(n)  # the ring: 2(N-1) = 6
            # the ring's bytes, give or take
            assert abs(elements - 2 * (n - 1) / n * numel) <= 2 * math.log2(n)


def test_halving_doubling_refuses_a_world_size_that_is_not_a_power_of_two(monkeypatch):
    monkeypatch.setattr(halving_doubling.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(halving_doubling.dist, "get_world_size", lambda: 3)
    with pytest.raises(UserError, match="power-of-two"):
        halving_doubling.halving_doubling_all_reduce(torch.ones(4))


def test_on_an_infinitely_fast_link_the_recorded_runs_are_predicted_at_lab_1s_speed():
    """N ranks sharing the same 2 cores split lab 1's step N ways in 1/N of the machine:
    the same time; with nothing to send, the model's tokens/s at every rank count are
    lab 1's."""
    runs = json.loads(RECORDED.read_text())["runs"]
    lab1 = next(r for r in runs if r["lab"] == "lab1_single")
    rows = recorded_runs_check(Link("free", alpha=0.0, busbw=math.inf, source="test"))
    assert [row["ranks"] for row in rows] == [1, 2, 4]
    for row in rows:
        lab2 = next(
            r
            for r in runs
            if r["lab"] == "lab2_ddp" and r["world_size"] == row["ranks"]
        )
        assert row["predicted"] == pytest.approx(lab1["tokens_per_s"])
        assert row["measured"] == lab2["tokens_per_s"] and row[
            "ratio"
        ] == pytest.approx(row["predicted"] / row["measured"])


def test_the_gpu_backward_benchmark_refuses_a_cpu_and_its_record_is_its_own():
    # the suite runs without CUDA (tests/conftest.py)
    with pytest.raises(UserError, match="CUDA"):
        backward_ready.main(["--repeats", "1"])
    # the page reads a result this very file made: re-record it after changing the file
    recorded = json.loads(BACKWARD_READY.read_text())["script_sha256"]
    source = Path(backward_ready.__file__).read_bytes()
    assert recorded == hashlib.sha256(source).hexdigest()
