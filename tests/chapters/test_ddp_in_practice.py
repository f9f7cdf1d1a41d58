"""DDP in practice, what the page does not run: the hand-written synchronised BatchNorm
on unequal shards and per process group, the exact evaluation on 3 ranks, the
collective log's tags, and the checker catching padded shards. The page checks its own
launches on every build (the uneven-input timeout and Join's fix with its collectives,
ZeRO under Join, DDP's buffer broadcasts, BatchNorm under DDP, the evaluation on 2
ranks)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.exercises import check_exact_evaluation
from distlab.infra.launch import run_ranks
from distlab.scratch.sync_batchnorm import convert_sync_batchnorm_on_gloo
from distlab.tools.collective_lanes import CollectiveLog
from distlab.tools.exact_eval import (
    eval_data,
    naive_evaluations,
    one_process_mean,
    per_sample_loss,
)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


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
    return (
        out.detach(),
        x.grad,
        bn.weight.grad,
        bn.bias.grad,
        bn.running_mean,
        bn.running_var,
    )


def test_the_hand_written_sync_batchnorm_equals_one_process_on_unequal_shards():
    ranks = run_ranks(sync_layer_on_rank, nprocs=2, quiet=True, timeout=60)
    layer = nn.BatchNorm1d(3)
    x = X.clone().requires_grad_()
    out = layer(x)
    (out * UPSTREAM).sum().backward()
    assert rel(torch.cat([r[0] for r in ranks]), out.detach()) < 1e-6
    assert rel(torch.cat([r[1] for r in ranks]), x.grad) < 1e-5
    # local sums, which DDP would reduce
    assert rel(ranks[0][2] + ranks[1][2], layer.weight.grad) < 1e-6
    assert rel(ranks[0][3] + ranks[1][3], layer.bias.grad) < 1e-6
    for r in ranks:
        assert (
            rel(r[4], layer.running_mean) < 1e-6 and rel(r[5], layer.running_var) < 1e-6
        )


GROUP_ROWS = 2  # rows per rank in the process-group test


def grouped_layer_on_rank():
    """4 ranks in groups of 2: each group normalises over its own ranks' rows."""
    mine, groups = dist.new_subgroups(group_size=2)
    layer = convert_sync_batchnorm_on_gloo(
        nn.Sequential(nn.BatchNorm1d(3)), process_group=mine
    )
    rank = dist.get_rank()
    x = X[rank * GROUP_ROWS : (rank + 1) * GROUP_ROWS].clone().requires_grad_()
    out = layer(x)
    (out * UPSTREAM[rank * GROUP_ROWS : (rank + 1) * GROUP_ROWS]).sum().backward()
    result = (out.detach(), x.grad, layer[0].running_mean.clone())
    for group in groups:
        dist.destroy_process_group(group)
    return result


def test_sync_batchnorm_with_a_process_group_normalises_each_group_alone():
    ranks = run_ranks(grouped_layer_on_rank, nprocs=4, quiet=True, timeout=90)
    for first in (0, 2):  # one process per group, on its 2 ranks' rows
        rows = slice(first * GROUP_ROWS, (first + 2) * GROUP_ROWS)
        layer = nn.BatchNorm1d(3)
        x = X[rows].clone().requires_grad_()
        out = layer(x)
        (out * UPSTREAM[rows]).sum().backward()
        pair = ranks[first : first + 2]
        assert rel(torch.cat([r[0] for r in pair]), out.detach()) < 1e-6
        assert rel(torch.cat([r[1] for r in pair]), x.grad) < 1e-5
        for r in pair:
            assert rel(r[2], layer.running_mean) < 1e-6


def test_the_collective_log_tags_the_innermost_call_and_restores_what_it_wrapped(
    monkeypatch,
):
    """Collectives stand in as entries of a fake flight recorder."""
    import types

    import distlab.tools.collective_lanes as lanes

    entries = []
    monkeypatch.setattr(lanes, "recorded", lambda: list(entries))
    fake = types.SimpleNamespace()
    fake.inner = inner = lambda: entries.append(("all_reduce", 1))

    def outer():
        entries.append(("broadcast", 4))
        fake.inner()

    fake.outer = outer
    log = CollectiveLog()
    log.tag(fake, "inner", "inner")
    log.tag(fake, "outer", "outer", ends_phase="step {n}")
    fake.outer()
    entries.append(("all_reduce", 2))  # issued by no tagged call
    log.mark("end")
    assert log.phases(lambda kind: f"untagged {kind}") == [
        ("step 1", [("broadcast", 4, "outer"), ("all_reduce", 1, "inner")]),
        ("end", [("all_reduce", 2, "untagged all_reduce")]),
    ]
    log.restore()
    assert fake.inner is inner and fake.outer is outer


def evaluations_on_ranks(n):
    model, dataset = eval_data(n)
    return naive_evaluations(model, dataset)


# the page checks 2 ranks and 5 samples on every build
@pytest.mark.parametrize("nprocs,n", [(3, 7)])
def test_exact_evaluation_counts_every_sample_once(nprocs, n):
    model, dataset = eval_data(n)
    truth = one_process_mean(model, dataset)
    ranks = run_ranks(
        evaluations_on_ranks, nprocs=nprocs, args=(n,), quiet=True, timeout=60
    )
    assert all(r == ranks[0] for r in ranks)
    # fp32 losses, computed in batches of another size
    assert abs(ranks[0]["exact"] / truth - 1) < 1e-6
    for name, value in ranks[0].items():
        # padding counts the first samples twice, drop_last skips the last
        if name != "exact":
            assert abs(value / truth - 1) > 0.01, name


def padded_sum(model, dataset):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    from torch.utils.data.distributed import DistributedSampler

    mine = list(
        DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    )
    total = torch.tensor(
        [per_sample_loss(model, *dataset[mine]).sum().item(), len(mine)],
        dtype=torch.float64,
    )
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def test_the_checker_names_the_padding():
    """The page runs the checker on its answer (it passes on every build); here, a
    wrong one."""
    with pytest.raises(AssertionError, match="padded shards"):
        check_exact_evaluation(padded_sum)
