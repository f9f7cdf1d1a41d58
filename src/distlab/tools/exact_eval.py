"""Distributed evaluation that counts every sample exactly once, and the usual mistakes.

``DistributedSampler`` pads each rank's shard to the same length by repeating the first
samples, so a metric summed over padded shards counts them twice; ``drop_last`` skips
the tail. ``evaluate_exactly`` keeps the padded sampler (every rank runs the same
batches, which a model with collectives in its forward needs), masks the repeats, and
all-reduces one (sum, count) pair after the loop.

    mean_loss = evaluate_exactly(model, dataset)   # on every rank of the group
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data.distributed import DistributedSampler

from distlab.runtime import rank_world

TRUE_W = torch.tensor([[1.0], [-2.0], [0.5]])


def per_sample_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error of each sample, (B,)."""
    return (model(x) - y).pow(2).sum(1)


# --- begin exact ---
@torch.no_grad()
def evaluate_exactly(model: nn.Module, dataset, batch_size: int = 2) -> float:
    """The mean loss over every sample of ``dataset`` exactly once, the same on
    every rank.

    The shards are DistributedSampler's (shuffle off, padded: every rank runs the same
    number of batches, which a model whose forward has collectives needs); the padding
    is masked out.
    """
    rank, world_size = rank_world()
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=False
    )
    indices = list(sampler)
    # (sum of losses, samples): float64 keeps counts exact
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        x, y = (torch.stack(t) for t in zip(*[dataset[i] for i in batch]))
        # rank r holds positions r, r + N, r + 2N, ... of the padded order; those past
        # the end are repeats
        real = torch.tensor(
            [rank + (start + j) * world_size < len(dataset) for j in range(len(batch))]
        )
        total[0] += per_sample_loss(model, x, y)[real].sum().double()
        total[1] += real.sum()
    dist.all_reduce(total)  # one collective, after the loop
    return (total[0] / total[1]).item()


# --- end exact ---


@torch.no_grad()
def naive_evaluations(
    model: nn.Module, dataset, batch_size: int = 2
) -> dict[str, float]:
    """The usual mistakes, on every rank: the mean of the ranks' means over padded
    shards, the sum and count over padded shards, and the same with ``drop_last``."""
    rank, world_size = rank_world()
    out = {}
    for name, drop_last in (("padded", False), ("drop_last", True)):
        idx = list(
            DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=False,
                drop_last=drop_last,
            )
        )
        losses = per_sample_loss(
            model, *(torch.stack(t) for t in zip(*[dataset[i] for i in idx]))
        )
        totals = torch.tensor(
            [losses.mean().item(), losses.sum().item(), len(idx)], dtype=torch.float64
        )
        dist.all_reduce(totals)
        out[f"mean of rank means, {name}"] = (totals[0] / world_size).item()
        out[f"sum / count, {name}"] = (totals[1] / totals[2]).item()
    out["exact"] = evaluate_exactly(model, dataset, batch_size)
    return out


def eval_data(n: int) -> tuple[nn.Module, torch.utils.data.TensorDataset]:
    """A fixed regressor and ``n`` samples whose losses differ a lot (so a
    repeat shows)."""
    torch.manual_seed(0)
    x = torch.randn(n, 3)
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Linear(3, 1)
    return model, torch.utils.data.TensorDataset(
        x, x @ TRUE_W + torch.arange(n, dtype=torch.float32)[:, None]
    )


def one_process_mean(model: nn.Module, dataset) -> float:
    with torch.no_grad():
        return per_sample_loss(model, *dataset.tensors).double().mean().item()
