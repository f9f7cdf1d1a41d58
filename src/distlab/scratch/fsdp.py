"""Fully sharded data parallel from scratch: flat shards, gathered per unit, freed
after use.

    # on every rank, same weights: each keeps 1/N of them
    fsdp = shard_model(model, {Block})
    # sees only the shards: ZeRO-1/2/3
    optimizer = torch.optim.AdamW(model.parameters())
    # hooks all-gather, free and reduce-scatter per unit
    model(x, y)[1].backward()
    optimizer.step()

Any ``nn.Module`` with a unit policy, a set of module classes, as FSDP2's users write it
(``fully_shard`` on every block, then on the model): every submodule of one of those
classes is a unit, and the root unit holds the rest (``distlab.scratch.fsdp_units``). A
unit's parameters become one padded flat fp32 tensor, of which a rank keeps its 1/N
slice, registered as one ``nn.Parameter`` per original parameter (its piece of the
slice). Frozen parameters make a unit of their own; unused ones keep ``grad=None``;
``ignored_params`` are left alone. The full flat tensor exists only while the unit
computes:

    forward:  all-gather -> forward -> free (units; the root keeps it for backward)
    backward: all-gather again (if freed) -> backward -> reduce-scatter the gradient
              -> free

``compute_dtype=torch.bfloat16`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the fp32 shards (the master weights) are cast to bf16 before the
all-gather, each unit computes in bf16 (its floating-point inputs are cast, as FSDP2's
``cast_forward_inputs`` does), and the gradients are reduce-scattered in fp32.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.scratch.fsdp_units import unit_parameters


@dataclass
class Event:
    """One timed piece of a step on this rank (seconds from ``time.perf_counter``)."""

    unit: str  # "root", "blocks.0", ...: the unit module's name in the model
    what: str  # "all-gather", "forward", "backward", "reduce-scatter" or "free"
    start: float
    end: float
    gathered_bytes: int  # bytes of full (gathered) flat parameters alive when it ended


class FlatShardUnit:
    """One unit's parameters as a padded flat tensor: a 1/N shard kept, the rest
    gathered on use."""

    # --- begin shard ---
    def __init__(self, name: str, module: nn.Module, slots: dict, owner: ScratchFSDP):
        self.name, self.owner, self.is_root = name, owner, module is owner.model
        self.group = owner.group
        rank, n = dist.get_rank(self.group), dist.get_world_size(self.group)
        params = list(slots)  # all trainable, or all frozen (ScratchFSDP splits them)
        self.trainable = params[0].requires_grad
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        # so that N equal slices cover it
        self.padding = math.ceil(total / n) * n - total
        flat = torch.cat(
            [p.detach().reshape(-1).float() for p in params]
            + [params[0].new_zeros(self.padding, dtype=torch.float32)]
        )  # (padded,) fp32 whatever the model's dtype: the master weights
        # this rank's slice is the only lasting copy (padded / N,)
        self.shard = flat.chunk(n)[rank].clone()
        # the optimizer sees one Parameter per original parameter: the piece of it
        # that falls in this rank's slice (maybe empty), a view of the shard
        size, ends = self.shard.numel(), [0, *itertools.accumulate(self.numels)]
        lo = rank * size  # parameter i spans ends[i]:ends[i + 1] of the flat tensor

        def here(i):  # a flat index, clipped to this rank's slice, in shard indices
            return min(max(i - lo, 0), size)

        self.slices = [slice(here(a), here(b)) for a, b in zip(ends, ends[1:])]
        self.pieces = [
            nn.Parameter(self.shard[s], requires_grad=self.trainable)
            for s in self.slices
        ]
        for i, piece in enumerate(self.pieces):  # shard_0, ... (frozen_0, ...)
            module.register_parameter(
                f"{'shard' if self.trainable else 'frozen'}_{i}", piece
            )
        # the full flat tensor, in the compute dtype: a leaf whose .grad collects the
        # unit's whole gradient; it keeps its shape for good, its storage only while
        # gathered (padded,)
        self.full = flat.to(owner.compute_dtype or flat.dtype)
        self.full.requires_grad_(self.trainable)
        self.owners, self.used = list(slots.values()), set()
        for owners in self.owners:  # drop the originals: no full copy survives wrapping
            for m, attr in owners:
                del m._parameters[attr]
        self.free()
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        if self.trainable:
            self.full.register_post_accumulate_grad_hook(self._post_backward)

    # --- end shard ---

    def _point_modules_at(self, tensors: list) -> None:
        for tensor, owners in zip(tensors, self.owners):
            for m, attr in owners:  # a tied parameter: one tensor for all its owners
                setattr(m, attr, tensor)

    def _record(self, what: str, start: float) -> None:
        if self.owner.trace is not None:
            self.owner.trace.append(
                Event(
                    self.name,
                    what,
                    start,
                    time.perf_counter(),
                    self.owner.gathered_bytes(),
                )
            )

    # --- begin gather ---
    def gather(self) -> None:
        """All-gather the shards into ``full``, unless it is already there."""
        storage = self.full.untyped_storage()
        if storage.nbytes() > 0:
            return
        start = time.perf_counter()
        storage.resize_(self.full.numel() * self.full.element_size())
        # write through .data: no version-counter bump, so the tensors autograd saved in
        # forward (views of this same storage) are valid again for backward. The shard
        # is cast first (a no-op in fp32): in bf16 half the bytes cross the wire
        dist.all_gather_single(
            self.full.data, self.shard.data.to(self.full.dtype), group=self.group
        )
        self._record("all-gather", start)

    def free(self) -> None:
        start = time.perf_counter()
        # saved views keep their shapes, lose their bytes
        self.full.untyped_storage().resize_(0)
        # reading a view of freed storage would read freed memory (a segfault):
        # unset them
        self._point_modules_at([None] * len(self.owners))
        self._record("free", start)

    def _pre_forward(self, module, args, kwargs):
        self.gather()
        # fresh views each forward, made with autograd on: their gradients flow
        # into full
        views = torch.split(self.full, self.numels + [self.padding])
        tensors = [v.view(shape) for v, shape in zip(views, self.shapes)]
        for i, t in enumerate(tensors):
            if t.requires_grad:  # a gradient reaching it marks parameter i used
                t.register_hook(lambda grad, i=i: self.used.add(i))
        self._point_modules_at(tensors)
        self.forward_start = time.perf_counter()
        dtype = self.owner.compute_dtype
        if dtype is None:
            return None

        # floating-point inputs computed in the unit's dtype (FSDP2:
        # cast_forward_inputs=True)
        def cast(t):
            return (
                t.to(dtype)
                if isinstance(t, torch.Tensor) and t.is_floating_point()
                else t
            )

        return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}

    def _post_forward(self, module, args, output):
        self._record("forward", self.forward_start)
        outputs = [
            t
            for t in (output if isinstance(output, tuple) else (output,))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        # ZeRO-3: keep nothing but the shard until backward. Not the root: backward
        # starts with the layers that ran last, which are usually the root's. No
        # backward, no keeping.
        if not outputs or (self.owner.reshard_after_forward and not self.is_root):
            self.free()
        # fires at the first gradient of an output: before the unit's backward
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, self._pre_backward, mode="any"
            )
        return output

    def _pre_backward(self, grad) -> None:
        self.gather()
        self.backward_start = time.perf_counter()
        # frozen: no gradient, so no post-backward hook; free when backward ends
        if not self.trainable:
            torch.autograd.Variable._execution_engine.queue_callback(self.free)

    # --- end gather ---

    # --- begin reduce ---
    def _post_backward(self, full: torch.Tensor) -> None:
        """Runs once ``full.grad`` holds this rank's whole gradient for the unit."""
        self._record("backward", self.backward_start)
        start = time.perf_counter()
        n = dist.get_world_size(self.group)
        shard_grad = torch.empty_like(self.shard)  # (padded / N,) fp32
        # reduced in the shard's dtype (fp32), however the unit computed: bf16 sums lose
        # bits. SUM then divide: the loss is a mean over the global batch, so the
        # gradient is the mean of the ranks' gradients. Forgetting the division
        # multiplies it by N.
        grad = full.grad.to(self.shard.dtype)  # (padded,)
        dist.reduce_scatter_single(
            shard_grad, grad, op=dist.ReduceOp.SUM, group=self.group
        )
        shard_grad.div_(n)
        self.accumulate(shard_grad)
        full.grad = None  # the full gradient goes too
        self._record("reduce-scatter", start)
        self.free()

    def accumulate(self, shard_grad: torch.Tensor) -> None:
        """Give each used parameter's piece its slice of ``shard_grad``; an unused one
        keeps ``grad=None``, as in one process, and AdamW skips it."""
        for i in sorted(self.used):
            piece, grad = self.pieces[i], shard_grad[self.slices[i]]
            # += : gradient accumulation over micro-batches
            piece.grad = grad if piece.grad is None else piece.grad + grad
        self.used.clear()

    # --- end reduce ---


class ScratchFSDP:
    """The units of one model, sharded over ``group`` (None: all ranks); ``trace`` (a
    list) collects ``Event``s when given."""

    def __init__(
        self,
        model: nn.Module,
        units,
        reshard_after_forward: bool = True,
        trace: list[Event] | None = None,
        group: dist.ProcessGroup | None = None,
        compute_dtype: torch.dtype | None = None,
        unit_class: type[FlatShardUnit] = FlatShardUnit,
        ignored_params: set[nn.Parameter] = frozenset(),
    ):
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(
                "compute_dtype must be a floating-point dtype such as "
                f"torch.bfloat16, got {compute_dtype}"
            )
        self.model, self.reshard_after_forward, self.trace = (
            model,
            reshard_after_forward,
            trace,
        )
        self.group, self.compute_dtype, self.units = group, compute_dtype, []
        # all found before any is sharded; ignored parameters stay as they are
        for name, module, slots in unit_parameters(model, units, ignored_params):
            # frozen parameters: a unit of their own, gathered, never reduced
            for trainable in (True, False):
                mine = {p: o for p, o in slots.items() if p.requires_grad == trainable}
                if mine:
                    unit_name = name if trainable else f"{name} (frozen)"
                    self.units.append(unit_class(unit_name, module, mine, self))

    def gathered_bytes(self) -> int:
        """Bytes this rank holds right now in full (gathered) flat parameters."""
        return sum(u.full.untyped_storage().nbytes() for u in self.units)


def shard_model(
    model: nn.Module,
    units,
    *,
    reshard_after_forward: bool = True,
    trace: list[Event] | None = None,
    group: dist.ProcessGroup | None = None,
    compute_dtype: torch.dtype | None = None,
    unit_class: type[FlatShardUnit] = FlatShardUnit,
    ignored_params: set[nn.Parameter] = frozenset(),
) -> ScratchFSDP:
    """Shard ``model`` in place (call on every rank of ``group``, all holding the
    same weights).

    ``units``: the unit policy, module classes (``{Block}``); every submodule of one of
    them is a unit, the rest goes to the root. ``compute_dtype``: compute in it (bf16),
    keep fp32 shards and reduce in fp32. ``unit_class``: a ``FlatShardUnit`` subclass to
    build the units with. ``ignored_params``: left whole on every rank and not
    reduced, as FSDP2's ``fully_shard(..., ignored_params=...)``.
    """
    return ScratchFSDP(
        model,
        units,
        reshard_after_forward,
        trace,
        group,
        compute_dtype,
        unit_class,
        ignored_params,
    )
