"""DDP in practice: the uneven-input hang caught and Join's fix, BatchNorm under DDP and synchronised
BatchNorm against one process, and an exact distributed evaluation."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.chapters.ddp_in_practice import (
    bn_demo,
    bn_reference,
    eval_data,
    evaluate_exactly,
    naive_evaluations,
    one_process_mean,
    per_sample_loss,
    torch_sync_batchnorm_on_cpu,
    uneven_demo,
    uneven_reference,
)
from distlab.exercises import check_exact_evaluation
from distlab.infra.launch import run_ranks
from distlab.infra.observe import observe
from distlab.scratch.sync_batchnorm import convert_sync_batchnorm_on_gloo


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_a_rank_with_fewer_batches_leaves_the_other_waiting_until_the_timeout():
    outcome = observe(uneven_demo, [2, 1], False, True, 1.5, pg_timeout=1.0, timeout=60)
    r0, r1 = outcome.results
    assert (r0["steps"], r1["steps"]) == (1, 1) and r1["error"] is None
    assert "Timed out" in r0["error"] and 0.9 < r0["waited_s"] < 5  # an error within the timeout, not a hang


@pytest.mark.parametrize("divide", [True, False])
def test_join_finishes_every_rank_and_matches_one_process(divide):
    outcome = observe(uneven_demo, [4, 3], True, divide, pg_timeout=5.0, timeout=60)
    ref = uneven_reference([4, 3], divide)
    r0, r1 = outcome.results
    assert outcome.failure is None and (r0["steps"], r1["steps"]) == (4, 3)
    assert (r0["shadowed"], r1["shadowed"]) == (0, 1)  # rank 1 shadowed rank 0's one extra backward
    assert all(rel(g, h) < 1e-5 for g, h in zip(r0["grads"], ref["grads"], strict=True))
    assert rel(r0["weights"], ref["weights"]) < 1e-6 and torch.equal(r0["weights"], r1["weights"])
    assert rel(r1["left_loop"], ref["weights"]) > 1e-2  # a step behind, until Join's final broadcast
    assert r0["step_collectives"] == {"allreduce_": 3}  # the gradient bucket, and Join's two announcements


def bn_variants():
    return {
        "default": bn_demo(),
        "no_broadcast": bn_demo(broadcast_buffers=False),
        "sync": bn_demo(sync=True),
        "torch": torch_sync_batchnorm_on_cpu(),
    }


def test_batchnorm_under_ddp_broadcast_buffers_and_synchronised_batchnorm():
    ranks = run_ranks(bn_variants, nprocs=2, quiet=True, timeout=120)
    one = bn_reference()
    (d0, n0, s0), (d1, n1, s1) = ([r[k] for k in ("default", "no_broadcast", "sync")] for r in ranks)
    # DDP averages exactly; the per-shard statistics make that average another gradient
    assert torch.equal(d0["grad0"], d0["mean_of_local"]) and torch.equal(d0["grad0"], d1["grad0"])
    assert rel(d0["grad0"], one["grad0"]) > 0.05
    # broadcast_buffers: the same training, the running statistics (and eval outputs) of rank 0
    assert torch.equal(d0["weights"], n0["weights"])
    assert torch.equal(d0["running_mean"], d1["running_mean"]) and torch.equal(d0["probe"], d1["probe"])
    assert not torch.allclose(n0["running_mean"], n1["running_mean"]) and not torch.allclose(n0["probe"], n1["probe"])
    assert not torch.allclose(d0["running_mean"], one["running_mean"])
    # synchronised BatchNorm: one process, to fp32 rounding
    for key in ("grad0", "weights", "running_mean", "running_var", "probe"):
        assert rel(s0[key], one[key]) < 1e-5, key
    assert n0["collectives"] == {"backward allreduce": 1}
    assert set(d0["collectives"]) == {"forward broadcast", "backward allreduce"}
    assert s0["collectives"]["forward allgather"] == 1 and s0["collectives"]["backward allreduce"] == 2
    assert ranks[0]["torch"]["forward"].startswith("ValueError: SyncBatchNorm expected input tensor to be on GPU")
    assert ranks[0]["torch"]["DDP(model)"] == "ValueError: SyncBatchNorm layers only work with GPU modules"


X = torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(0))  # (B, C, L)
UPSTREAM = torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(1))
SHARDS = [slice(0, 3), slice(3, 8)]  # unequal: 3 rows and 5


def sync_layer_on_rank():
    layer = convert_sync_batchnorm_on_gloo(nn.Sequential(nn.BatchNorm1d(3)))
    mine = SHARDS[dist.get_rank()]
    x = X[mine].clone().requires_grad_()
    out = layer(x)
    (out * UPSTREAM[mine]).sum().backward()
    bn = layer[0]
    return out.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var


def test_the_hand_written_sync_batchnorm_equals_one_process_on_unequal_shards():
    ranks = run_ranks(sync_layer_on_rank, nprocs=2, quiet=True, timeout=60)
    layer = nn.BatchNorm1d(3)
    x = X.clone().requires_grad_()
    out = layer(x)
    (out * UPSTREAM).sum().backward()
    assert rel(torch.cat([r[0] for r in ranks]), out.detach()) < 1e-6
    assert rel(torch.cat([r[1] for r in ranks]), x.grad) < 1e-5
    assert rel(ranks[0][2] + ranks[1][2], layer.weight.grad) < 1e-6  # local sums, which DDP would reduce
    assert rel(ranks[0][3] + ranks[1][3], layer.bias.grad) < 1e-6
    for r in ranks:
        assert rel(r[4], layer.running_mean) < 1e-6 and rel(r[5], layer.running_var) < 1e-6


def evaluations_on_ranks(n):
    model, dataset = eval_data(n)
    return naive_evaluations(model, dataset)


@pytest.mark.parametrize("nprocs,n", [(2, 5), (3, 7)])
def test_exact_evaluation_counts_every_sample_once(nprocs, n):
    model, dataset = eval_data(n)
    truth = one_process_mean(model, dataset)
    ranks = run_ranks(evaluations_on_ranks, nprocs=nprocs, args=(n,), quiet=True, timeout=60)
    assert all(r == ranks[0] for r in ranks)
    assert abs(ranks[0]["exact"] / truth - 1) < 1e-6  # fp32 losses, computed in batches of another size
    for name, value in ranks[0].items():
        if name != "exact":  # padding counts the first samples twice, drop_last skips the last
            assert abs(value / truth - 1) > 0.01, name


def padded_sum(model, dataset):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torch.utils.data.distributed import DistributedSampler

    mine = list(DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False))
    total = torch.tensor([per_sample_loss(model, *dataset[mine]).sum().item(), len(mine)], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def test_the_checker_passes_the_exact_evaluation_and_names_the_padding(capsys):
    check_exact_evaluation(evaluate_exactly)
    assert capsys.readouterr().out.startswith("passed:")
    with pytest.raises(AssertionError, match="padded shards"):
        check_exact_evaluation(padded_sum)
