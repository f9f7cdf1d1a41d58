"""Feeding the ranks: DistributedSampler's exact rules, two loading strategies, seeds and
DataLoader workers, sharding by rank x worker, mp.spawn."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from distlab.chapters.feeding_ranks import (
    SOURCES,
    SeedProbe,
    both_strategies,
    epoch_order,
    expected_layout,
    expected_shards,
    sampler_epochs,
    samples_read,
    seeds_on_ranks,
    time_strategies,
    try_spawn,
    visit_counts,
    worker_draws,
)
from distlab.data import TokenData, load_corpus
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT
from distlab.runtime import rank_world
from distlab.tools.sharding import ShardedIterable, shard_sizes

SIZES = [(n, N) for n in range(1, 23) for N in range(1, 8)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_the_rule_written_out_matches_the_sampler(shuffle, drop_last):
    """Pad from the start of the order (or cut its tail), then deal rank r positions r::N."""
    for n, N in SIZES:
        for epoch in (0, 3):
            got = sampler_epochs(n, N, epochs=epoch + 1, shuffle=shuffle, drop_last=drop_last)[epoch]
            order = epoch_order(n, epoch, shuffle)
            assert got == expected_shards(order, N, drop_last), (n, N, epoch)
            layout = expected_layout(n, N, drop_last)
            assert [len(s) for s in got] == [layout.per_rank] * N
            sampler = DistributedSampler(range(n), num_replicas=N, rank=N - 1, drop_last=drop_last)
            assert len(sampler) == layout.per_rank


def test_sampler_lengths_round_up_without_drop_last_and_down_with_it():
    plain = DistributedSampler(range(10), num_replicas=4, rank=0)
    dropping = DistributedSampler(range(10), num_replicas=4, rank=0, drop_last=True)
    assert (len(plain), len(dropping)) == (3, 2)
    layout = expected_layout(10, 4, drop_last=False)
    assert (layout.per_rank, layout.total, layout.padded, layout.dropped) == (3, 12, 2, 0)
    layout = expected_layout(10, 4, drop_last=True)
    assert (layout.per_rank, layout.total, layout.padded, layout.dropped) == (2, 8, 0, 2)
    assert expected_layout(3, 4, drop_last=True).per_rank == 0  # fewer samples than ranks


@pytest.mark.parametrize("n,N", [(10, 3), (12, 4), (101, 8), (7, 7)])
def test_with_drop_last_the_shards_are_disjoint_and_cover_all_but_the_tail(n, N):
    shards = sampler_epochs(n, N, drop_last=True)[0]
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)) == n - n % N  # disjoint; n % N samples skipped
    assert set(seen) == set(epoch_order(n, 0)[: n - n % N])  # the skipped ones: the tail


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


def feed_on_ranks():
    results = both_strategies(steps=3, global_batch=8, block_size=32)
    timings = time_strategies(global_batches=(8,), block_size=32, batches=3, warmup=1)
    return dist.get_rank(), results, timings


def test_both_strategies_give_every_rank_the_same_rows_as_one_process():
    ranks = run_ranks(feed_on_ranks, nprocs=2, quiet=True, timeout=120)
    data = TokenData(load_corpus())
    for step in range(3):
        x_one, y_one = data.batch("train", step, 8, 32, 1337)  # one process, all rows
        for rank, results, _ in ranks:
            x_own, y_own, x_sc, y_sc = results[step]
            assert x_own.shape == (4, 32)
            assert torch.equal(x_own, x_sc) and torch.equal(y_own, y_sc)
            assert torch.equal(x_own, x_one[rank * 4 : (rank + 1) * 4])
            assert torch.equal(y_own, y_one[rank * 4 : (rank + 1) * 4])
    for _rank, _, timings in ranks:
        for strategy in ("own_shard", "scatter"):
            assert len(timings[strategy][8]) == 3 and all(t > 0 for t in timings[strategy][8])


def _run(cmd, timeout=150):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_spawn_example_and_torchrun_train_alike():
    script = str(REPO_ROOT / "src" / "examples" / "spawn_example.py")
    spawned = _run([sys.executable, script, "--nprocs", "2", "--steps", "3", "--device", "cpu"])
    assert spawned.returncode == 0, spawned.stderr[-2000:]
    lines = sorted(spawned.stdout.splitlines())
    assert [ln.split(":")[0] for ln in lines] == ["rank 0/2 (gloo, cpu)", "rank 1/2 (gloo, cpu)"]
    launched = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            script,
            "--steps",
            "3",
            "--device",
            "cpu",
        ]
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert sorted(launched.stdout.splitlines()) == lines  # same data, same seed, same losses


def test_spawn_needs_a_function_it_can_pickle_by_name():
    assert try_spawn(print, nprocs=1, timeout=60) == "ok"
    assert "pickle" in try_spawn(lambda rank: None, nprocs=1, timeout=60).lower()


class EveryItem(IterableDataset):
    """The naive stream: every copy, in every worker of every rank, yields all items."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        yield from self.items


def seeds_workers_and_shards():
    items = list(range(40))
    splits = {"naive": EveryItem(items), "by rank x worker": ShardedIterable(items)}
    return rank_world()[0], seeds_on_ranks(trials=30), worker_draws(), samples_read(splits, workers=2)


def test_seeds_workers_and_sharding_inside_two_ranks():
    """DDP hides a per-rank init, not shared dropout masks; DataLoader workers run inside the
    ranks, get their seeds from the rank's generator, and copy a dataset's own generator;
    sharding by rank x worker reads each item once where the naive stream reads it 4 times."""
    ranks = run_ranks(seeds_workers_and_shards, nprocs=2, quiet=True, timeout=120)
    assert [r[0] for r in ranks] == [0, 1]
    seeds = ranks[0][1]
    assert seeds["rank"] == 0 and {**seeds, "rank": 1} == ranks[1][1]  # gathered or averaged: equal on both
    assert seeds["init"] == [False, True]  # different weights before DDP, rank 0's after
    assert seeds["mask_agree"]["same"] == 1.0 and 0.4 < seeds["mask_agree"]["per_rank"] < 0.6
    assert seeds["grad_var"]["same"] > seeds["grad_var"]["per_rank"] > 0

    def values(rank, mode, source, worker):
        return [d[source] for d in ranks[rank][2][mode] if d["worker"] == worker]

    for worker in (0, 1):
        seed0, seed1 = (values(r, "same", "seed", worker) for r in (0, 1))
        assert seed0 == seed1  # one torch seed on both ranks: the same worker seeds
        assert values(0, "per_rank", "seed", worker) != values(1, "per_rank", "seed", worker)
    assert values(0, "same", "seed", 1)[0] == values(0, "same", "seed", 0)[0] + 1  # base_seed + worker id
    for source in SOURCES:
        copied = source == "dataset's rng"  # not reseeded: the same draws in every worker, on every rank
        assert (values(0, "per_rank", source, 0) == values(0, "per_rank", source, 1)) is copied
        assert (values(0, "per_rank", source, 0) == values(1, "per_rank", source, 0)) is copied
        assert values(0, "same", source, 0) == values(1, "same", source, 0)

    reads = [r[3] for r in ranks]
    assert visit_counts([r["naive"] for r in reads], 40) == [4] * 40  # 2 ranks x 2 workers
    assert visit_counts([r["by rank x worker"] for r in reads], 40) == [1] * 40


@pytest.mark.parametrize("n,world,workers", [(64, 2, 2), (1003, 3, 2), (5, 3, 2)])  # at most 2 workers: CI has 2 cores
def test_sharded_iterable_reads_each_item_once_with_ranks_set_by_hand(n, world, workers):
    """Ranks simulated in one process (rank and world_size passed), real DataLoader workers."""
    reads = []
    for rank in range(world):
        loader = DataLoader(ShardedIterable(list(range(n)), rank, world), batch_size=None, num_workers=workers)
        reads.append([int(i) for i in loader])
    assert visit_counts(reads, n) == [1] * n
    assert [len(r) for r in reads] == [sum(s) for s in shard_sizes(n, world, workers)]
    single = [int(i) for i in DataLoader(ShardedIterable(list(range(n)), 0, 1), batch_size=None)]
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
    info.dataset.rng = np.random.default_rng(info.seed)  # info.seed = base_seed + worker_id


def test_a_worker_init_fn_gives_each_worker_its_own_dataset_rng():
    """The answer to the page's last exercise: without it both workers draw the same numbers."""
    for init_fn, copied in ((None, True), (seed_dataset_rng, False)):
        torch.manual_seed(0)
        items = list(DataLoader(SeedProbe(6), batch_size=None, num_workers=2, worker_init_fn=init_fn))
        per_worker = [[d["dataset's rng"] for d in items if d["worker"] == w] for w in (0, 1)]
        assert (per_worker[0] == per_worker[1]) is copied
