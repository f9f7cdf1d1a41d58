"""Activation checkpointing, measured: what a block saves, what each policy keeps, what
it costs.

The checkpointing itself lives in ``parallel.apply_activation_checkpointing`` (the labs
use it); this module holds the from-scratch version the chapter starts from and the
tools that
check and measure it:

* ``CheckpointedBlock``: ``torch.utils.checkpoint`` around one block, by hand;
* ``forward_ops``: the aten operators a forward pass dispatches (what a policy is
  shown);
* ``recording``: a policy wrapper that counts what the policy decided, and
  ``check_policy_saves``, which fails loudly when a selective policy saves nothing;
* ``activation_memory``: bytes kept for backward, by saved-tensor hooks and by PyTorch's
  memory tracker, and the peak during the backward pass;
* ``fsdp2_orders``: checkpointing combined with FSDP2, in both wrapping orders.

Step times are measured by ``distlab.bench.ac``, which records them in ``results/``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from distlab.memory import saved_activation_bytes, tracker_snapshot
from distlab.model import GPT, preset
from distlab.parallel import apply_activation_checkpointing, save_ops_policy
from distlab.runtime import dist_env, pick_device, rank_world


class CheckpointedBlock(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing: only its input
    is kept."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Wrap every block of a GPT in ``CheckpointedBlock``, in place (model.py
    stays untouched)."""
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
    """Names of the aten operators ``module(*inputs)`` dispatches, in order: the level
    at which a selective-checkpointing policy sees the computation (composite ops such
    as ``aten.linear`` are already decomposed here, into ``t`` and ``addmm``)."""
    with _OpRecorder() as recorder:
        module(*inputs)
    return recorder.ops


def saved_tensors(module: nn.Module, *inputs) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of each distinct storage ``module(*inputs)`` saves for backward,
    in the order autograd saves them; parameters (model state) are left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (tuple(t.shape), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return list(seen.values())


def recording(policy: Callable) -> tuple[Callable, collections.Counter]:
    """``policy``, plus a counter of its forward-pass decisions: ``{(op, decision):
    count}``."""
    counts: collections.Counter = collections.Counter()

    def recorded(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:  # during backward it is asked again for the same ops
            counts[(str(op), decision.name)] += 1
        return decision

    return recorded, counts


def check_policy_saves(
    policy: Callable, preset_name: str = "tiny"
) -> collections.Counter:
    """Run one forward of a selectively checkpointed GPT and return ``{op: times
    saved}``.

    Raises if the policy saved nothing: a policy that names ops the model never
    dispatches (``aten.mm`` packets instead of ``aten.mm.default`` overloads, composite
    ops such as ``aten.linear``, or ``mm`` on a model whose Linears have biases and run
    ``addmm``) silently turns selective checkpointing into full checkpointing.
    """
    recorded, counts = recording(policy)
    cfg = preset(preset_name)
    model = apply_activation_checkpointing(GPT(cfg), "selective", policy=recorded)
    idx = torch.zeros(1, cfg.block_size, dtype=torch.long)
    model(idx, idx)
    saved = collections.Counter(
        {op: n for (op, decision), n in counts.items() if decision == "MUST_SAVE"}
    )
    if not saved:
        seen = sorted({op for op, _ in counts})
        raise ValueError(
            "the selective policy saved no operator's output, so it recomputes "
            "everything "
            f"(full checkpointing). The blocks ran: {', '.join(seen)}"
        )
    return saved


def activation_memory(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor
) -> dict[str, int]:
    """Activation bytes of one forward and backward pass, two ways.

    ``hooks``: storages packed by ``saved_tensors_hooks``
    (``memory.saved_activation_bytes``). It cannot see what selective checkpointing
    caches, which bypasses autograd's saving. ``saved``: bytes PyTorch's ``MemTracker``
    counts as activations right after the forward pass (the logits dropped): everything
    kept for backward, whatever kept it. ``peak``: the tracker's peak of activations
    plus temporaries during forward and backward, recomputed blocks included.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    hooks = saved_activation_bytes(model, idx, targets)
    # the model's bytes: on a GPU the tracker counts CPU ones apart
    device = next(model.parameters()).device
    kinds = lambda snapshot: {str(k).rsplit(".", 1)[-1]: v for k, v in snapshot.items()}  # noqa: E731
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        logits, loss = model(idx, targets)
        # the caller's output, not something autograd keeps (cross-entropy saved
        # its own)
        del logits
        now = kinds(tracker_snapshot(tracker, "current", device))
        loss.backward()
    top = kinds(tracker_snapshot(tracker, "peak", device))
    model.zero_grad(set_to_none=True)
    return {"hooks": hooks, "saved": now["ACT"], "peak": top["ACT"] + top["TEMP"]}


def build(
    preset_name: str,
    mode: str = "none",
    every: int = 1,
    policy: Callable | None = None,
    seed: int = 0,
) -> GPT:
    """A GPT of ``preset_name`` with activation checkpointing applied (same weights for
    a seed)."""
    return apply_activation_checkpointing(
        GPT(preset(preset_name), seed=seed), mode, every, policy
    )


def gradients(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor
) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(idx, targets)[1].backward()
    return [p.grad.clone() for p in model.parameters()]


# (wrapping order, checkpoint implementation, mode): the combinations with
# FSDP2 compared
FSDP2_ORDERS = [
    ("checkpoint, then shard", "non-reentrant", "full"),
    ("checkpoint, then shard", "non-reentrant", "selective"),
    ("checkpoint, then shard", "reentrant", "full"),
    ("shard, then checkpoint", "non-reentrant", "full"),
    ("shard, then checkpoint", "reentrant", "full"),
]


def fsdp2_orders(preset_name: str = "tiny", global_batch: int = 8) -> list[dict]:
    """Run on every rank (``run_ranks``): one forward and backward under FSDP2 for each
    of ``FSDP2_ORDERS``. Per combination: the largest difference between the reassembled
    gradients and one process's without checkpointing, and, from the profiler, how often
    FSDP2's pre-forward hook ran per block and how many all-gathers ran (c10d's own op
    name, the same on gloo and NCCL)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from distlab.parallel import apply_fsdp
    from distlab.tools.ac_timeline import hook_sequence, mark_block_forwards

    rank, world = rank_world()
    # NCCL ranks need their model and data on their GPU
    device = pick_device("auto", dist_env()[1])
    cfg = preset(preset_name)
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(
        0, cfg.vocab_size, (2, global_batch, cfg.block_size), generator=gen
    ).to(device)
    reference = gradients(GPT(cfg).to(device), idx, targets)
    rows = idx.shape[0] // world
    mine = slice(rank * rows, (rank + 1) * rows)
    results = []
    for order, impl, mode in FSDP2_ORDERS:
        kwargs = {
            "checkpoint_impl": CheckpointImpl.REENTRANT
            if impl == "reentrant"
            else CheckpointImpl.NO_REENTRANT
        }
        if mode == "selective":
            kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(
                save_ops_policy()
            )
        # moved before sharding: apply_fsdp builds its mesh on this device
        model = GPT(cfg).to(device)

        # bound now: called in this iteration
        def wrap_blocks(model=model, kwargs=kwargs):
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block, **kwargs)

        if order.startswith("checkpoint"):
            wrap_blocks()
            apply_fsdp(model)
        else:
            apply_fsdp(model)
            wrap_blocks()
        marks = mark_block_forwards(model)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = model(idx[mine], targets[mine])[1]
            with torch.profiler.record_function("backward"):
                loss.backward()
        for handle in marks:
            handle.remove()
        names = [event.name for event in prof.events()]
        diff = max(
            (p.grad.full_tensor() - r).abs().max().item()
            for p, r in zip(model.parameters(), reference)
        )
        results.append(
            {
                "order": order,
                "checkpoint": impl,
                "mode": mode,
                "grad_max_abs_diff": diff,
                "pre_forward_per_block": sum(
                    n.startswith("FSDP::pre_forward (blocks.") for n in names
                )
                / cfg.n_layer,
                # gloo:all_gather, nccl:_all_gather_base
                "all_gathers": names.count("c10d::_allgather_base_"),
                "sequence": hook_sequence(prof.events()),
            }
        )
    return results


def options_demo(seed: int = 0) -> dict:
    """Three options of ``torch.utils.checkpoint``, each on a small case.

    ``preserve_rng_state``: a ``tiny`` block with dropout 0.1, checkpointed with and
    without it, against no checkpointing (max gradient difference). ``determinism
    _check``: a function whose recompute saves a tensor of another shape than its
    first run (the error's first line). ``checkpoint_sequential``: four blocks in two
    segments (bytes saved for backward, against no checkpointing)."""
    from torch.utils.checkpoint import CheckpointError, checkpoint_sequential

    cfg = dataclasses.replace(preset("tiny"), dropout=0.1)
    block = GPT(cfg, seed=seed).blocks[0].train()
    x = torch.randn(4, cfg.block_size, cfg.n_embd, generator=torch.Generator())

    def grads(run) -> list[torch.Tensor]:
        torch.manual_seed(seed)  # the same dropout masks for every variant
        run(x.clone().requires_grad_()).sum().backward()
        out = [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
        return out

    def diff(got, want) -> float:
        return max((g - w).abs().max().item() for g, w in zip(got, want))

    plain = grads(block)
    rng = {
        keep: diff(
            grads(lambda t, k=keep: checkpoint(block, t, use_reentrant=False,
                                               preserve_rng_state=k)),
            plain,
        )
        for keep in (True, False)
    }  # fmt: skip
    calls = []

    def shifting(t):  # its recompute keeps one column fewer: a bug to catch
        calls.append(t)
        return t[:, : t.shape[1] - len(calls) + 1].exp().sum()

    try:
        checkpoint(shifting, x.clone().requires_grad_(), use_reentrant=False).backward()
        caught = "no error"
    except CheckpointError as err:
        caught = str(err).strip().splitlines()[0]
    blocks = nn.Sequential(*GPT(dataclasses.replace(cfg, n_layer=4)).blocks).eval()
    wanted = x.clone().requires_grad_()
    sequential = {
        "none": saved_bytes(lambda: blocks(wanted)),
        "2 segments": saved_bytes(
            lambda: checkpoint_sequential(blocks, 2, wanted, use_reentrant=False)
        ),
    }
    return {"rng": rng, "determinism": caught, "sequential": sequential}


def saved_bytes(run: Callable) -> int:
    """Bytes of the distinct storages ``run()`` saves for backward (its inputs'
    included)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


__all__ = [
    "CheckpointedBlock",
    "checkpoint_blocks",
    "forward_ops",
    "saved_tensors",
    "recording",
    "check_policy_saves",
    "activation_memory",
    "build",
    "gradients",
    "save_ops_policy",
    "fsdp2_orders",
    "options_demo",
    "saved_bytes",
]
