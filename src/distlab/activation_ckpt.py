"""Activation checkpointing, measured: what a block saves, what each policy keeps, what it costs.

The checkpointing itself lives in ``parallel.apply_activation_checkpointing`` (the labs use
it); this module holds the from-scratch version the chapter starts from and the tools that
check and measure it:

* ``CheckpointedBlock``: ``torch.utils.checkpoint`` around one block, by hand;
* ``forward_ops``: the aten operators a forward pass dispatches (what a policy is shown);
* ``recording``: a policy wrapper that counts what the policy decided, and
  ``check_policy_saves``, which fails loudly when a selective policy saves nothing;
* ``activation_memory``: bytes kept for backward, by saved-tensor hooks and by PyTorch's
  memory tracker, and the peak during the backward pass;
* ``time_train_steps``: seconds per training step (forward, backward, AdamW).
"""
from __future__ import annotations

import collections
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from distlab.memory import saved_activation_bytes
from distlab.model import GPT, preset
from distlab.parallel import apply_activation_checkpointing, save_ops_policy


class CheckpointedBlock(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing: only its input is kept."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Wrap every block of a GPT in ``CheckpointedBlock``, in place (model.py stays untouched)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = CheckpointedBlock(block)
    return model


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def forward_ops(module: nn.Module, *inputs) -> list[str]:
    """Names of the aten operators ``module(*inputs)`` dispatches, in order: the level at which a
    selective-checkpointing policy sees the computation (composite ops such as ``aten.linear``
    are already decomposed here, into ``t`` and ``addmm``)."""
    with _OpRecorder() as recorder:
        module(*inputs)
    return recorder.ops


def recording(policy: Callable) -> tuple[Callable, collections.Counter]:
    """``policy``, plus a counter of its forward-pass decisions: ``{(op, decision): count}``."""
    counts: collections.Counter = collections.Counter()

    def recorded(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:  # during backward it is asked again for the same ops
            counts[(str(op), decision.name)] += 1
        return decision
    return recorded, counts


def check_policy_saves(policy: Callable, preset_name: str = "tiny") -> collections.Counter:
    """Run one forward of a selectively checkpointed GPT and return ``{op: times saved}``.

    Raises if the policy saved nothing: a policy that names ops the model never dispatches
    (``aten.mm`` packets instead of ``aten.mm.default`` overloads, composite ops such as
    ``aten.linear``, or ``mm`` on a model whose Linears have biases and run ``addmm``)
    silently turns selective checkpointing into full checkpointing.
    """
    recorded, counts = recording(policy)
    cfg = preset(preset_name)
    model = apply_activation_checkpointing(GPT(cfg), "selective", policy=recorded)
    idx = torch.zeros(1, cfg.block_size, dtype=torch.long)
    model(idx, idx)
    saved = collections.Counter({op: n for (op, decision), n in counts.items() if decision == "MUST_SAVE"})
    if not saved:
        seen = sorted({op for op, _ in counts})
        raise ValueError(f"the selective policy saved no operator's output, so it recomputes everything "
                         f"(full checkpointing). The blocks ran: {', '.join(seen)}")
    return saved


def activation_memory(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, int]:
    """Activation bytes of one forward and backward pass, two ways.

    ``hooks``: storages packed by ``saved_tensors_hooks`` (``memory.saved_activation_bytes``).
    It cannot see what selective checkpointing caches, which bypasses autograd's saving.
    ``saved``: bytes PyTorch's ``MemTracker`` counts as activations right after the forward
    pass (the logits dropped): everything kept for backward, whatever kept it.
    ``peak``: the tracker's peak of activations plus temporaries during forward and backward,
    recomputed blocks included.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    hooks = saved_activation_bytes(model, idx, targets)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        logits, loss = model(idx, targets)
        del logits  # the caller's output, not something autograd keeps (cross-entropy saved its own)
        after_forward = tracker.get_tracker_snapshot("current")
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")
    (device,) = after_forward  # one device
    kinds = lambda snapshot: {str(k).rsplit(".", 1)[-1]: v for k, v in snapshot[device].items()}  # noqa: E731
    now, top = kinds(after_forward), kinds(peak)
    model.zero_grad(set_to_none=True)
    return {"hooks": hooks, "saved": now["ACT"], "peak": top["ACT"] + top["TEMP"]}


def time_train_steps(model: nn.Module, batch: int, steps: int = 5, warmup: int = 2, seed: int = 0) -> float:
    """Median seconds of a training step (forward, backward, AdamW) after ``warmup`` steps."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size), generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        model(idx, targets)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(preset_name: str, mode: str = "none", every: int = 1, policy: Callable | None = None,
          seed: int = 0) -> GPT:
    """A GPT of ``preset_name`` with activation checkpointing applied (same weights for a seed)."""
    return apply_activation_checkpointing(GPT(preset(preset_name), seed=seed), mode, every, policy)


def gradients(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(idx, targets)[1].backward()
    return [p.grad.clone() for p in model.parameters()]


__all__ = ["CheckpointedBlock", "checkpoint_blocks", "forward_ops", "recording", "check_policy_saves",
           "activation_memory", "time_train_steps", "build", "gradients", "save_ops_policy"]
