"""Parallelism applied to a model from outside, so ``model.py`` never changes.

Order matters when several are combined (torchtitan's rule, which later chapters use):
activation checkpointing first, then ``torch.compile``, then the data-parallel wrapper
(FSDP2's ``fully_shard``); DDP wraps the finished module last of all.
"""
from __future__ import annotations

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
