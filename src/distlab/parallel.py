"""Parallelism applied to a model from outside, so ``model.py`` never changes.

Order matters when several are combined (torchtitan's rule, which later chapters use):
activation checkpointing first, then ``torch.compile``, then the data-parallel wrapper
(FSDP2's ``fully_shard``); DDP wraps the finished module last of all.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, device: torch.device, **ddp_kwargs) -> DDP:
    """Wrap ``model`` (already on ``device``) in DistributedDataParallel.

    Move first, wrap second: DDP registers its gradient hooks and buffers for the
    parameters it is given, and broadcasts rank 0's values to every rank right here.
    On a GPU, ``device_ids`` names this rank's one device; on a CPU it must stay unset.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, **ddp_kwargs)


def apply_fsdp(model: nn.Module, mesh=None, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None) -> nn.Module:
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
