"""The one cost model (``distlab.costs``): collectives on a ring, NCCL's channel per
NIC across nodes, DDP's bucket timeline and the strategies as data."""

import pytest

from distlab.costs.buckets import steady_buckets, steady_ready, timeline
from distlab.costs.collectives import (
    RING_FACTOR,
    Link,
    collective_s,
    cross_node_busbw,
    ring_bytes_sent,
    ring_s,
)
from distlab.costs.state import per_rank_bytes
from distlab.costs.strategies import PARTS, STRATEGIES
from distlab.planner.hardware import GPUS, NETWORKS
from distlab.planner.predict import Plan, gpu_cluster, predict
from distlab.planner.shapes import shape

LINK = Link("test", alpha=5e-6, busbw=100e9, source="test", base=8e-6)


def test_a_ring_collective_costs_its_steps_and_the_bytes_one_rank_sends():
    n, s = 8, 1e9
    for kind, factor in RING_FACTOR.items():
        assert ring_bytes_sent(kind, s, n) == factor(n) * s
    assert ring_bytes_sent("all-reduce", s, n) == 2 * 7 / 8 * s
    # an all-reduce is a reduce-scatter and an all-gather, paying the call once
    ar, ag, rs = (
        collective_s("all-reduce", s, n, LINK),
        collective_s("all-gather", s, n, LINK),
        collective_s("reduce-scatter", s, n, LINK),
    )
    assert ag + rs == pytest.approx(ar + LINK.base)
    assert collective_s("all-gather", s, 1, LINK) == 0  # a group of one sends nothing
    assert ring_s(s, n, LINK.alpha, LINK.busbw) == pytest.approx(ar - LINK.base)


def test_across_nodes_a_ring_runs_a_channel_per_nic_up_to_the_link_inside():
    # 8 NICs of 200 Gb/s: 200 GB/s, not one NIC's 25 (review finding #1)
    assert cross_node_busbw(8, 25e9, 300e9) == 200e9
    assert cross_node_busbw(8, 50e9, 300e9) == 300e9  # NVLink caps it
    a100 = GPUS["a100-80gb"]
    for name, net in NETWORKS.items():
        bw = gpu_cluster("a100-80gb", 64, 8, name).inter.busbw
        assert bw == min(net.nics_per_node * net.nic_bandwidth, a100.nvlink_bandwidth)
    # a reader's nccl-tests figure replaces the estimate
    assert gpu_cluster("a100-80gb", 64, 8, "ib-200g", busbw=150e9).inter.busbw == 150e9
    with pytest.raises(ValueError, match="busbw must be a positive"):
        gpu_cluster("a100-80gb", 64, 8, "ib-200g", busbw=0)


def test_one_nics_line_rate_would_make_cross_node_fsdp2_communication_far_slower():
    """The bug the review found, run as a mutation: the planner's cross-node gathers and
    reduce-scatters at one NIC's rate instead of a channel per NIC."""
    model, plan = shape("llama3-8b"), Plan("fsdp2", 1, 8192, ac="selective-op")
    right = predict(model, gpu_cluster("a100-80gb", 64, 8, "ib-200g"), plan)
    one_nic = gpu_cluster("a100-80gb", 64, 8, "ib-200g", busbw=25e9)
    wrong = predict(model, one_nic, plan)
    ratio = wrong["time"]["communication"] / right["time"]["communication"]
    # 8x the bandwidth term; the latencies (alpha per step, once per call) stay
    assert 5 < ratio < 8
    assert wrong["time"]["exposed"] > 10 * right["time"]["exposed"]


def test_buckets_wait_for_backward_when_nothing_overlaps():
    sizes = steady_buckets(100 * 2**20)
    assert sizes[0] == 2**20 and sum(sizes) == 100 * 2**20
    ready = steady_ready(sizes)
    assert ready[-1] == 1.0 and ready == sorted(ready)
    over = timeline(1.0, sizes, ready, lambda b: b / 1e9, overlap=True)
    serial = timeline(1.0, sizes, ready, lambda b: b / 1e9, overlap=False)
    assert serial["exposed"] == pytest.approx(serial["comm"])
    assert over["exposed"] < serial["exposed"]


def test_strategies_are_rows_that_say_what_each_shards_and_sends():
    assert set(STRATEGIES) == {
        "ddp",
        "zero1",
        "zero2",
        "fsdp2",
        "fsdp2-no-reshard",
        "hsdp",
    }
    for s in STRATEGIES.values():
        assert set(s.sharded) <= set(PARTS)
        assert (s.gathered is None) == ("params" not in s.sharded)
    # the ZeRO paper's 16 bytes per parameter, divided by N once everything is sharded
    assert per_rank_bytes(1e9, 8, strategy="fsdp2")["total"] == 16e9 / 8
    assert per_rank_bytes(1e9, 64, strategy="hsdp", group_size=8)["total"] == 16e9 / 8
