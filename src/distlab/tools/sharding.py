"""Shard an ``IterableDataset`` by rank x DataLoader worker, so each sample is read once
per epoch.

A map-style dataset is sharded by its sampler (``DistributedSampler``) in the rank's
main process, and the DataLoader hands the workers disjoint indices. An
``IterableDataset`` has no sampler: every copy of it, one per worker process of every
rank, runs ``__iter__`` from the start, so it has to pick its own part of the stream.
With N ranks of W workers there are N x W readers; reader ``rank * W + worker`` takes
items ``k`` with ``k % (N * W)`` equal to its number:

    dataset = ShardedIterable(file_names)  # rank and world size read here, once
    loader = DataLoader(dataset, batch_size=None, num_workers=4)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch.utils.data import IterableDataset, get_worker_info

from distlab.runtime import rank_world


# --- begin worker_shard ---
def worker_shard(rank: int, world_size: int) -> tuple[int, int]:
    """``(this reader's number, number of readers)`` for the rank and the DataLoader
    worker this runs in. In the rank's main process (``num_workers=0``) the rank is the
    only reader."""
    info = get_worker_info()  # None outside a worker process
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * workers + worker, world_size * workers


class ShardedIterable(IterableDataset):
    """Yield this reader's share of ``items``: every ``(N x W)``-th item, from its
    own offset."""

    def __init__(
        self, items: Sequence, rank: int | None = None, world_size: int | None = None
    ):
        if (rank is None) != (world_size is None):
            raise ValueError(
                "give both rank and world_size, or neither (they are then read "
                "from the job)"
            )
        # read in the rank's main process, where the process group or torchrun's
        # environment is known for sure; the workers get a copy of the dataset, these
        # numbers included
        self.rank, self.world_size = (
            (rank, world_size) if rank is not None else rank_world()
        )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        self.items = items

    def __iter__(self) -> Iterator:
        reader, readers = worker_shard(self.rank, self.world_size)
        for k in range(reader, len(self.items), readers):
            yield self.items[k]


# --- end worker_shard ---


def shard_sizes(n: int, world_size: int, workers: int) -> list[list[int]]:
    """``[rank][worker] -> items`` that reader yields from ``n`` items: equal only when
    N x W divides n."""
    readers = world_size * workers
    return [
        [len(range(r * workers + w, n, readers)) for w in range(workers)]
        for r in range(world_size)
    ]
