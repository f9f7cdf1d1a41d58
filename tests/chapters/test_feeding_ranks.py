"""Feeding the ranks: DistributedSampler's exact rules (rebuilt in
distlab.scratch.sampler), sharding by rank x worker set by hand. The page checks its own
launch on every build (the two loading strategies against one process, seeds and
DataLoader workers inside two ranks, forkserver workers); these tests cover the rules
over many sizes, the error paths, the drawn deal and the exercises."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from distlab.chapters.feeding_ranks import SeedProbe, sampler_epochs, visit_counts
from distlab.scratch.sampler import (
    deal_html,
    epoch_order,
    expected_layout,
    expected_shards,
    padded_order,
)
from distlab.tools.sharding import ShardedIterable, shard_sizes

SIZES = [(n, N) for n in range(1, 23) for N in range(1, 8)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_the_rule_written_out_matches_the_sampler(shuffle, drop_last):
    """Pad from the start of the order (or cut its tail), then deal rank r
    positions r::N."""
    for n, N in SIZES:
        for epoch in (0, 3):
            got = sampler_epochs(
                n, N, epochs=epoch + 1, shuffle=shuffle, drop_last=drop_last
            )[epoch]
            order = epoch_order(n, epoch, shuffle)
            assert got == expected_shards(order, N, drop_last), (n, N, epoch)
            layout = expected_layout(n, N, drop_last)
            assert [len(s) for s in got] == [layout.per_rank] * N
            sampler = DistributedSampler(
                range(n), num_replicas=N, rank=N - 1, drop_last=drop_last
            )
            assert len(sampler) == layout.per_rank


def test_sampler_lengths_round_up_without_drop_last_and_down_with_it():
    plain = DistributedSampler(range(10), num_replicas=4, rank=0)
    dropping = DistributedSampler(range(10), num_replicas=4, rank=0, drop_last=True)
    assert (len(plain), len(dropping)) == (3, 2)
    layout = expected_layout(10, 4, drop_last=False)
    assert (layout.per_rank, layout.total, layout.padded, layout.dropped) == (
        3,
        12,
        2,
        0,
    )
    layout = expected_layout(10, 4, drop_last=True)
    assert (layout.per_rank, layout.total, layout.padded, layout.dropped) == (
        2,
        8,
        0,
        2,
    )
    # fewer samples than ranks
    assert expected_layout(3, 4, drop_last=True).per_rank == 0


@pytest.mark.parametrize("n,N", [(10, 3), (12, 4), (101, 8), (7, 7)])
def test_with_drop_last_the_shards_are_disjoint_and_cover_all_but_the_tail(n, N):
    shards = sampler_epochs(n, N, drop_last=True)[0]
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)) == n - n % N  # disjoint; n % N samples skipped
    # the skipped ones: the tail
    assert set(seen) == set(epoch_order(n, 0)[: n - n % N])


@pytest.mark.parametrize("n,N", [(10, 3), (10, 4), (2, 5), (101, 8)])
def test_without_drop_last_the_order_is_padded_from_its_start(n, N):
    shards = sampler_epochs(n, N, drop_last=False)[0]
    counts = visit_counts(shards, n)
    layout = expected_layout(n, N, drop_last=False)
    assert min(counts) >= 1 and sum(counts) == layout.total  # everything, plus padding
    order = epoch_order(n, 0)
    repeated = (order * N)[: layout.padded]  # cycles when more than n are missing
    extra = [i for i in range(n) for _ in range(counts[i] - 1)]
    assert sorted(extra) == sorted(repeated)


def test_without_set_epoch_every_epoch_has_the_same_order():
    forgot = sampler_epochs(10, 2, epochs=5, set_epoch=False)
    assert all(epoch == forgot[0] for epoch in forgot)
    assert forgot[0] == sampler_epochs(10, 2, epochs=1)[0]  # always epoch 0's order
    called = sampler_epochs(10, 2, epochs=5, set_epoch=True)
    assert len({tuple(map(tuple, epoch)) for epoch in called}) == 5


def test_ranks_with_different_seeds_overlap_and_miss_samples():
    shards = [sampler_epochs(1000, 2, seed=rank)[0][rank] for rank in range(2)]
    counts = visit_counts(shards, 1000)
    assert counts.count(2) > 0 and counts.count(0) == counts.count(2)


def test_strided_deal_keeps_the_global_batch_of_one_process():
    """Per-rank batch b on N ranks = batch b*N in one process, from the same order."""
    n, N, b = 48, 4, 3
    shards = sampler_epochs(n, N, drop_last=True)[0]
    single = sampler_epochs(n, 1)[0][0]
    for step in range(n // (b * N)):
        union = sorted(i for s in shards for i in s[step * b : (step + 1) * b])
        assert union == sorted(single[step * b * N : (step + 1) * b * N])


def test_padding_cycles_through_the_order_when_ranks_outnumber_samples():
    assert padded_order([7, 8], 5, drop_last=False) == [7, 8, 7, 8, 7]
    assert padded_order([7, 8, 9], 2, drop_last=True) == [7, 8]
    assert expected_shards([7, 8], 5, drop_last=False) == [[7], [8], [7], [8], [7]]


def test_the_drawn_deal_fills_one_position_per_step_and_frames_the_repeats():
    """The widget's views: nothing dealt, then one more coloured cell per step, and the
    padded positions (10 and 11 of 10 samples on 4 ranks) in red frames throughout."""
    views = [deal_html(10, 4, k) for k in range(13)]
    coloured = [v.count("color:white") for v in views]
    # each dealt position is coloured twice: in the order and in its rank's row
    assert coloured == [2 * k for k in range(13)]
    assert all(v.count("#c0392b") >= 1 for v in views)
    assert "seen twice" in views[11] and "Dealt." in views[12]


# at most 2 workers: CI has 2 cores
@pytest.mark.parametrize("n,world,workers", [(64, 2, 2), (1003, 3, 2), (5, 3, 2)])
def test_sharded_iterable_reads_each_item_once_with_ranks_set_by_hand(
    n, world, workers
):
    """Ranks simulated in one process (rank and world_size passed), real
    DataLoader workers."""
    reads = []
    for rank in range(world):
        loader = DataLoader(
            ShardedIterable(list(range(n)), rank, world),
            batch_size=None,
            num_workers=workers,
        )
        reads.append([int(i) for i in loader])
    assert visit_counts(reads, n) == [1] * n
    assert [len(r) for r in reads] == [sum(s) for s in shard_sizes(n, world, workers)]
    single = [
        int(i)
        for i in DataLoader(ShardedIterable(list(range(n)), 0, 1), batch_size=None)
    ]
    assert single == list(range(n))  # no workers, one rank: the whole stream, in order


def test_exercise_shard_sizes_of_1003_records_on_3_ranks_of_4_workers():
    assert [sum(r) for r in shard_sizes(1003, 3, 4)] == [336, 335, 332]


def test_sharded_iterable_rejects_a_half_given_or_impossible_rank():
    with pytest.raises(ValueError, match="both"):
        ShardedIterable([1, 2], rank=1)
    with pytest.raises(ValueError, match="not in a world"):
        ShardedIterable([1, 2], rank=2, world_size=2)


def seed_dataset_rng(worker_id):
    info = get_worker_info()
    # info.seed = base_seed + worker_id
    info.dataset.rng = np.random.default_rng(info.seed)


def test_a_worker_init_fn_gives_each_worker_its_own_dataset_rng():
    """The answer to the page's last exercise: without it both workers draw the
    same numbers."""
    for init_fn, copied in ((None, True), (seed_dataset_rng, False)):
        torch.manual_seed(0)
        items = list(
            DataLoader(
                SeedProbe(6), batch_size=None, num_workers=2, worker_init_fn=init_fn
            )
        )
        per_worker = [
            [d["dataset's rng"] for d in items if d["worker"] == w] for w in (0, 1)
        ]
        assert (per_worker[0] == per_worker[1]) is copied
