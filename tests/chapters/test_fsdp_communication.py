"""Bytes per rank per step of DDP, ZeRO-1, FSDP2 and HSDP, counted from the collectives on 4 gloo
ranks; gloo's reduce-scatter sends twice the ring's bytes; FSDP2's accumulation switches skip the
collectives they name and give the gradients of one process."""

import pytest

from distlab.chapters import fsdp_communication as fc
from distlab.infra.launch import run_ranks
from distlab.tools.collective_bytes import RING_FACTOR


@pytest.fixture(scope="module")
def measured():
    ranks = run_ranks(fc.measure, nprocs=4, timeout=240)
    return ranks[0][0], ranks[0][1], [volumes for volumes, _ in ranks]


def test_ddp_and_zero1_hand_over_exactly_psi_per_collective_kind(measured):
    volumes, _, _ = measured
    ddp, zero1 = volumes["ddp"], volumes["zero1"]
    assert not any(v["unknown"] for v in volumes.values())  # every c10d op of a step is one C10D_OPS knows
    assert ddp["tensor_bytes"] == {"all-reduce": ddp["psi"]}  # every gradient once, no bucket order broadcast
    # ZeRO-1 in torch: DDP's full all-reduce, then every rank's updated slice broadcast (Psi in all)
    assert zero1["tensor_bytes"] == {"all-reduce": zero1["psi"], "broadcast": zero1["psi"]}
    assert ddp["ring_bytes"]["all-reduce"] == RING_FACTOR["all-reduce"](4) * ddp["psi"]


def test_fsdp2_gathers_twice_when_resharded_once_when_kept(measured):
    volumes, _, _ = measured
    for variant, gathers in (("fsdp2 reshard=True", 2), ("fsdp2 reshard=False", 1), ("fsdp2 reshard=2", 2)):
        moved = volumes[variant]["tensor_bytes"]
        # the all-gathered output and the reduce-scattered input are the same padded size
        assert moved["all-gather"] == gathers * moved["reduce-scatter"], variant
    psi = volumes["fsdp2 reshard=True"]["psi"]
    padded = volumes["fsdp2 reshard=True"]["tensor_bytes"]["reduce-scatter"]
    assert psi <= padded < 1.01 * psi  # dim 0 padded to a multiple of 4 ranks
    assert ("all-gather", 2) in volumes["fsdp2 reshard=2"]["group_sizes"]  # backward gathers in groups of 2
    ring = volumes["fsdp2 reshard=2"]["ring_bytes"]["all-gather"]
    assert ring == pytest.approx((RING_FACTOR["all-gather"](4) + RING_FACTOR["all-gather"](2)) * padded)


def test_hsdp_all_reduces_the_reduce_scattered_shard_across_replicas(measured):
    volumes, _, _ = measured
    hsdp = volumes["hsdp (2, 2)"]
    assert hsdp["tensor_bytes"]["all-reduce"] * 2 == hsdp["tensor_bytes"]["reduce-scatter"]
    assert {size for _, size in hsdp["group_sizes"]} == {2}


def test_gloo_reduce_scatter_sends_an_all_reduce(measured):
    """Socket bytes: all-gather and all-reduce as the ring; reduce-scatter at twice the ring."""
    _, _, per_rank = measured
    for volumes in per_rank:
        for variant in ("ddp", "fsdp2 reshard=True", "fsdp2 reshard=False", "fsdp2 reshard=2", "hsdp (2, 2)"):
            ring = volumes[variant]["ring_bytes"]
            gloo = sum(ring.values()) + ring.get("reduce-scatter", 0)
            assert volumes[variant]["socket_bytes"] == pytest.approx(gloo, rel=0.02), variant


def test_switches_skip_what_they_name_and_keep_the_gradients(measured):
    _, switches, _ = measured
    for name, run in switches.items():
        assert run["max_grad_diff"] < 1e-6, name  # against one process accumulating every rank's rows
    no_sync = switches["set_requires_gradient_sync(False)"]
    assert [c.get("reduce-scatter", 0) for c in no_sync["counts"]] == [0, 0, 0, 3]
    assert no_sync["grad_bytes_held"][:3] == [no_sync["psi"]] * 3  # whole gradients kept until the last
    kept = switches["... + set_reshard_after_backward(False)"]
    assert kept["ring_bytes"][1] < no_sync["ring_bytes"][1]  # the next forward needs no all-gather
    hsdp = switches["HSDP, set_requires_all_reduce(False)"]
    assert [c.get("all-reduce", 0) for c in hsdp["counts"]] == [0, 0, 0, 3]
    assert [c.get("reduce-scatter", 0) for c in hsdp["counts"]] == [3, 3, 3, 3]
