"""Parallelism applied to a model from outside, so ``model.py`` never changes.

Order matters when several are combined (torchtitan's rule, which later chapters use):
activation checkpointing first, then ``torch.compile``, then the data-parallel wrapper
(FSDP2's ``fully_shard``); DDP wraps the finished module last of all.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# --- begin activation checkpointing ---
AC_MODES = ("none", "full", "selective")


def _ops(*names: str) -> tuple:
    aten = torch.ops.aten  # attention kernels differ by device and build; keep those this torch has
    return tuple(getattr(aten, name).default for name in names if hasattr(aten, name))


# Outputs worth keeping: matrix products and attention (most of the FLOPs to recompute).
# Named as OpOverloads (``aten.addmm.default``): the policy sees those, never ``aten.addmm``.
# A Linear with a bias on a (B, T, C) input runs ``addmm``; without a bias, ``mm``.
SAVE_MATMULS_AND_ATTENTION = _ops(
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def save_ops_policy(save_ops=SAVE_MATMULS_AND_ATTENTION) -> Callable:
    """A selective-checkpointing policy: keep the outputs of ``save_ops`` from the forward
    pass, recompute everything else (LayerNorm, GELU, additions: cheap pointwise work)."""
    from torch.utils.checkpoint import CheckpointPolicy

    not_overloads = [op for op in save_ops if not isinstance(op, torch._ops.OpOverload)]
    if not_overloads:  # an OpOverloadPacket never equals the op the policy is shown: it would match nothing
        raise TypeError(f"name ops with their overload, e.g. torch.ops.aten.mm.default, not {not_overloads}")
    save = frozenset(save_ops)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(
    model: nn.Module, mode: str = "full", every: int = 1, policy: Callable | None = None
) -> nn.Module:
    """Checkpoint every ``every``-th transformer block of ``model``, in place.

    ``full``: a checkpointed block keeps only its input from the forward pass and runs its
    forward again inside the backward pass. ``selective``: it also keeps what ``policy``
    says to save (default: ``save_ops_policy()``) and recomputes only the rest.
    ``none`` leaves the model alone. Gradients are unchanged in every mode.

    Apply it before ``fully_shard``/DDP, so each FSDP unit is a checkpointed block.
    ``checkpoint_wrapper`` is non-reentrant and restores the RNG state for the recompute;
    its parameter names gain a ``_checkpoint_wrapped_module.`` part, which its state-dict
    hooks (and DCP's) strip, so checkpoints and ``model.pt`` keep the plain model's keys.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode not in AC_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {', '.join(AC_MODES)}")
    if every < 1:
        raise ValueError(f"every must be 1 or more (checkpoint every k-th block), got {every}")
    if mode == "none":
        return model
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy or save_ops_policy())
    for i, block in enumerate(model.blocks):
        if i % every == 0:
            model.blocks[i] = checkpoint_wrapper(block, **kwargs)
    return model


# --- end activation checkpointing ---


def apply_ddp(model: nn.Module, device: torch.device, **ddp_kwargs) -> DDP:
    """Wrap ``model`` (already on ``device``) in DistributedDataParallel.

    Move first, wrap second: DDP registers its gradient hooks and buffers for the
    parameters it is given, and broadcasts rank 0's values to every rank right here.
    On a GPU, ``device_ids`` names this rank's one device; on a CPU it must stay unset.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, **ddp_kwargs)


def apply_fsdp(
    model: nn.Module, mesh=None, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Shard ``model`` with FSDP2: each transformer block is one unit, then the root.

    A block's parameters are all-gathered just before its forward and (with
    ``reshard_after_forward``, ZeRO-3) freed right after it, then gathered again for its
    backward, where its gradients are reduce-scattered. The root unit holds what is left
    (embeddings, final LayerNorm; the head is tied to the token embedding). ``fully_shard``
    changes the model in place: its parameters become DTensors holding this rank's shard.

    ``param_dtype``: compute in this dtype (bf16) while the sharded parameters, the
    gradient reduction and the optimizer stay fp32. ``mesh``: a 1-D mesh shards over all
    ranks (the default); a 2-D mesh ("replicate", "shard") is hybrid sharding.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """FSDP2's counterpart of DDP's ``no_sync()``: backward inside the block keeps the
    gradients unsharded and local, with no reduce-scatter; the next backward outside it
    reduce-scatters the accumulated sum. The unsharded gradients cost a full copy of the
    gradients per rank while they accumulate (FSDP2's ``set_requires_gradient_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict on the CPU of rank 0 (empty on the other ranks).

    A collective: every rank must call it. The keys are the plain model's, so lab 1 loads it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
