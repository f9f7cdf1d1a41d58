"""ZeRO-1 from scratch: a sharded optimizer, each rank keeping the state of its shard.

    model = DDP(model)  # or any way of averaging the gradients
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model(x, y)[1].backward()  # every rank: the averaged gradients
    optimizer.step()  # steps this rank's shard, then every owner broadcasts its own
    optimizer.zero_grad()

Under DDP every rank runs the same optimizer step on the same averaged gradients and
keeps the same AdamW moments: N copies of 8 bytes per parameter. Here each parameter
has one owner rank; only the owner keeps its optimizer state and updates it, and then
sends the updated values to the others, so every rank still holds the whole model
for the next forward pass.

The partition is whole parameters, assigned greedily: largest first, each to the rank
that holds the fewest elements so far (ties to the lowest rank). It is the rule of
torch's ``ZeroRedundancyOptimizer`` (``_partition_parameters``), so the two partitions
and the two results are the same. A flat 1/N slice of every tensor (FSDP's layout)
would balance the bytes exactly, but then an optimizer that needs a whole tensor (a
norm per matrix, as LAMB or Muon take) could not run on a slice; whole parameters
leave the inner optimizer untouched, at the price of an uneven split, at most one
tensor's worth.

Torch's version can also pack the parameters into one buffer per rank
(``parameters_as_bucket_view``), overlap the broadcasts with DDP's backward
(``overlap_with_ddp``) and consolidate a whole ``state_dict`` on one rank; this one
broadcasts tensor by tensor and leaves the rest out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# --- begin partition ---
def partition(sizes: list[int], ranks: int) -> list[int]:
    """The owner rank of each tensor, from the tensors' sizes (numel): largest first,
    each to the rank with the fewest elements so far."""
    owner, load = [0] * len(sizes), [0] * ranks
    # sorted() is stable: equal sizes keep the parameters' order, as in torch
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = load.index(min(load))  # the first rank with the least
        owner[i], load[rank] = rank, load[rank] + sizes[i]
    return owner


# --- end partition ---


class ShardedOptimizer:
    """Any ``torch.optim`` optimizer, its state sharded over the ranks of ``group``."""

    # --- begin shard ---
    def __init__(self, params, optimizer_class: type, group=None, **defaults):
        self.group = group
        self.params = [p for p in params if p.requires_grad]
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        self.owner = partition([p.numel() for p in self.params], n)
        # broadcasts name the owner by its global rank, whatever the group
        self.src = [
            dist.get_global_rank(group or dist.group.WORLD, o) for o in range(n)
        ]
        # the inner optimizer sees this rank's parameters only, so its lazily made
        # state (AdamW: step, exp_avg, exp_avg_sq) exists for them alone
        mine = [p for p, o in zip(self.params, self.owner) if o == rank]
        # more ranks than tensors: a rank may own none (torch refuses an empty list)
        self.optimizer = optimizer_class(mine, **defaults) if mine else None

    # --- end shard ---

    # --- begin step ---
    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's shard with the (already averaged) gradients, then let each
        owner broadcast its updated parameters: afterwards every rank holds the whole
        updated model."""
        if self.optimizer is not None:
            self.optimizer.step()  # only the parameters this rank owns change
        # everyone else's copies are now stale: one broadcast per tensor, from its owner
        works = [
            dist.broadcast(p, src=self.src[o], group=self.group, async_op=True)
            for p, o in zip(self.params, self.owner)
        ]
        for work in works:
            work.wait()

    # --- end step ---

    def zero_grad(self, set_to_none: bool = True) -> None:
        # every rank computed every gradient (ZeRO-1 keeps them whole), so clear all
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @property
    def state(self) -> dict:
        """This rank's optimizer state (what ``distlab.memory.state_bytes`` counts)."""
        return self.optimizer.state if self.optimizer is not None else {}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(
            v.numel() * v.element_size()
            for s in self.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )


def owned_numel(sizes: list[int], ranks: int) -> list[int]:
    """Elements each rank owns under ``partition``: what its optimizer state scales
    with (AdamW: 8 bytes each, plus a 4-byte ``step`` per owned tensor)."""
    out = [0] * ranks
    for size, rank in zip(sizes, partition(sizes, ranks)):
        out[rank] += size
    return out
