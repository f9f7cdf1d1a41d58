"""Fully sharded data parallel from scratch: flat shards, gathered per unit, freed after use.

    fsdp = shard_model(model)          # on every rank, same weights: each keeps 1/N of them
    optimizer = torch.optim.AdamW(model.parameters())   # sees only the shards: ZeRO-1/2/3
    model(x, y)[1].backward()          # hooks all-gather, free and reduce-scatter per unit
    optimizer.step()

Units follow ``distlab.parallel.apply_fsdp``: each of ``model.blocks`` is one unit and the
root unit holds the rest (embeddings, final LayerNorm; the head is tied to ``wte``).
A unit's parameters become one padded flat fp32 tensor, of which a rank keeps its 1/N
slice as an ``nn.Parameter``. The full flat tensor exists only while the unit computes:

    forward:  all-gather -> forward -> free (blocks; the root keeps it for backward)
    backward: all-gather again (if freed) -> backward -> reduce-scatter the gradient -> free
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class Event:
    """One timed piece of a step on this rank (seconds from ``time.perf_counter``)."""

    unit: str  # "root", "block 0", ...
    what: str  # "all-gather", "forward", "backward", "reduce-scatter" or "free"
    start: float
    end: float
    gathered_bytes: int  # bytes of full (gathered) flat parameters alive when it ended


def unit_parameters(model: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    """``[(name, module, {parameter: [(owner, attribute), ...]})]``, blocks first, then root.

    A tied parameter (``lm_head.weight is wte.weight``) is one key with two owners, so it
    is stored, gathered and reduced once. The same traversal on an unwrapped copy of the
    model gives the same order, which is how the tests line a shard up with a reference.
    """

    def slots(modules):
        found: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        for m in modules:
            for attr, p in m._parameters.items():
                if p is not None:
                    found.setdefault(p, []).append((m, attr))
        return found

    in_blocks = {m for block in model.blocks for m in block.modules()}
    units = [(f"block {i}", b, slots(b.modules())) for i, b in enumerate(model.blocks)]
    return units + [("root", model, slots(m for m in model.modules() if m not in in_blocks))]


class FlatShardUnit:
    """One unit's parameters as a padded flat tensor: a 1/N shard kept, the rest gathered on use."""

    # --- begin shard ---
    def __init__(self, name: str, module: nn.Module, slots: dict, owner: ScratchFSDP):
        self.name, self.owner, self.is_root = name, owner, module is owner.model
        self.group = owner.group
        rank, n = dist.get_rank(self.group), dist.get_world_size(self.group)
        params = list(slots)
        self.shapes, self.numels = [p.shape for p in params], [p.numel() for p in params]
        total = sum(self.numels)
        self.padding = math.ceil(total / n) * n - total  # so that N equal slices cover it
        flat = torch.cat(
            [p.detach().reshape(-1) for p in params] + [params[0].new_zeros(self.padding)]
        ).float()  # (padded,)
        # this rank's slice is the only lasting copy: the optimizer sees nothing else
        self.shard = nn.Parameter(flat.chunk(n)[rank].clone())  # (padded / N,)
        module.register_parameter("flat_shard", self.shard)
        # the full flat tensor: a leaf whose .grad collects the unit's whole gradient;
        # it keeps its shape for good, its storage only while the unit is gathered
        self.full = flat.requires_grad_(True)  # (padded,)
        self.owners = list(slots.values())
        for owners in self.owners:  # drop the originals: no full copy survives wrapping
            for m, attr in owners:
                del m._parameters[attr]
        self.free()
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        self.full.register_post_accumulate_grad_hook(self._post_backward)

    # --- end shard ---

    def _point_modules_at(self, tensors: list) -> None:
        for tensor, owners in zip(tensors, self.owners):
            for m, attr in owners:  # a tied parameter: one tensor for all its owners
                setattr(m, attr, tensor)

    def _record(self, what: str, start: float) -> None:
        if self.owner.trace is not None:
            self.owner.trace.append(Event(self.name, what, start, time.perf_counter(), self.owner.gathered_bytes()))

    # --- begin gather ---
    def gather(self) -> None:
        """All-gather the shards into ``full``, unless it is already there."""
        storage = self.full.untyped_storage()
        if storage.nbytes() > 0:
            return
        start = time.perf_counter()
        storage.resize_(self.full.numel() * self.full.element_size())
        # write through .data: no version-counter bump, so the tensors autograd saved
        # in forward (views of this same storage) are valid again for backward
        dist.all_gather_single(self.full.data, self.shard.data, group=self.group)
        self._record("all-gather", start)

    def free(self) -> None:
        start = time.perf_counter()
        self.full.untyped_storage().resize_(0)  # saved views keep their shapes, lose their bytes
        # reading a view of freed storage would read freed memory (a segfault): unset them
        self._point_modules_at([None] * len(self.owners))
        self._record("free", start)

    def _pre_forward(self, module, args) -> None:
        self.gather()
        # fresh views each forward, made with autograd on: their gradients flow into full
        views = torch.split(self.full, self.numels + [self.padding])
        self._point_modules_at([v.view(shape) for v, shape in zip(views, self.shapes)])
        self.forward_start = time.perf_counter()

    def _post_forward(self, module, args, output):
        self._record("forward", self.forward_start)
        outputs = [
            t
            for t in (output if isinstance(output, tuple) else (output,))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # ZeRO-3: keep nothing but the shard until backward. Not the root: backward starts
        # with the head, which needs the root's parameters at once. No backward, no keeping.
        if not outputs or (self.owner.reshard_after_forward and not self.is_root):
            self.free()
        if outputs:  # fires at the first gradient of an output: before the unit's backward
            torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward, mode="any")
        return output

    def _pre_backward(self, grad) -> None:
        self.gather()
        self.backward_start = time.perf_counter()

    # --- end gather ---

    # --- begin reduce ---
    def _post_backward(self, full: torch.Tensor) -> None:
        """Runs once ``full.grad`` holds this rank's whole gradient for the unit."""
        self._record("backward", self.backward_start)
        start = time.perf_counter()
        n = dist.get_world_size(self.group)
        shard_grad = torch.empty_like(self.shard)  # (padded / N,)
        # SUM then divide: the loss is a mean over the global batch, so the gradient is
        # the mean of the ranks' gradients. Forgetting the division multiplies it by N.
        dist.reduce_scatter_single(shard_grad, full.grad, op=dist.ReduceOp.SUM, group=self.group)
        shard_grad.div_(n)
        if self.shard.grad is None:
            self.shard.grad = shard_grad
        else:  # gradient accumulation over micro-batches
            self.shard.grad += shard_grad
        full.grad = None  # the full gradient goes too
        self._record("reduce-scatter", start)
        self.free()

    # --- end reduce ---


class ScratchFSDP:
    """The units of one model, sharded over ``group`` (None: all ranks); ``trace`` (a
    list) collects ``Event``s when given."""

    def __init__(
        self,
        model: nn.Module,
        reshard_after_forward: bool = True,
        trace: list[Event] | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        self.model, self.reshard_after_forward, self.trace = model, reshard_after_forward, trace
        self.group, self.units = group, []
        for name, module, slots in unit_parameters(model):  # all found before any is sharded
            self.units.append(FlatShardUnit(name, module, slots, self))

    def gathered_bytes(self) -> int:
        """Bytes this rank holds right now in full (gathered) flat parameters."""
        return sum(u.full.untyped_storage().nbytes() for u in self.units)


def shard_model(
    model: nn.Module,
    reshard_after_forward: bool = True,
    trace: list[Event] | None = None,
    group: dist.ProcessGroup | None = None,
) -> ScratchFSDP:
    """Shard ``model`` in place (call on every rank of ``group``, all holding the same weights)."""
    return ScratchFSDP(model, reshard_after_forward, trace, group)
