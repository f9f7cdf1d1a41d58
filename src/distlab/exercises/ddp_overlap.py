"""The overlap and compression page, exercise: a comm hook that sends fp16, against
torch's own."""

import functools
from collections.abc import Callable

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.chapters.ddp_overlap import _batch, _model
from distlab.exercises._common import (
    on_ranks,
    passed,
    relative_difference,
    require_callable,
)
from distlab.tools.comm_bytes import CountedAllReduce

# the second step runs on the rebuilt buckets: a hook must work for any bucket
STEPS = 3
# fp16 has an 11-bit significand: dividing before or after the sum rounds differently
TOLERANCE = 2e-3


def _hooked_gradients(hook: Callable, bucket_cap_mb: float) -> dict:
    ddp = DDP(_model("tiny"), bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, hook)
    grads, sent, fp32 = [], [], 0
    for step in range(STEPS):
        x, y = _batch(step, 2, 32)
        ddp.zero_grad(set_to_none=True)
        with CountedAllReduce() as counted:
            ddp(x, y)[1].backward()
        sent.append(counted.bytes)
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
        fp32 = sum(p.numel() * 4 for p in ddp.parameters())
    return {"grads": grads, "sent": sent, "fp32_bytes": fp32}


def _both(hook: Callable, bucket_cap_mb: float) -> dict:
    return {
        "yours": _hooked_gradients(hook, bucket_cap_mb),
        "torch": _hooked_gradients(default_hooks.fp16_compress_hook, bucket_cap_mb),
    }


def check_fp16_hook(hook: Callable, bucket_cap_mb: float = 0.1) -> None:
    """``hook(process_group, bucket)`` must average the bucket over the ranks through an
    fp16 ``dist.all_reduce`` and return a future of the fp32 result, as
    ``fp16_compress_hook`` does: the same gradients (to TOLERANCE, relative) and half
    the fp32 bytes, on 2 ranks with several buckets."""
    require_callable(hook, "hook", "def hook(process_group, bucket): ...")
    ranks = on_ranks(functools.partial(_both, hook, bucket_cap_mb), 2, "your hook")
    for rank, got in enumerate(ranks):
        yours, torch_ = got["yours"], got["torch"]
        for step, (mine, want) in enumerate(
            zip(yours["grads"], torch_["grads"], strict=True)
        ):
            diff = relative_difference(mine, want)
            if diff > TOLERANCE:
                hint = (
                    " (did you divide by the world size?)"
                    if abs(relative_difference(mine, 2 * want)) < TOLERANCE
                    else ""
                )
                raise AssertionError(
                    f"rank {rank}, step {step}: gradients {diff:.1e} off "
                    f"fp16_compress_hook's{hint}"
                )
        half = yours["fp32_bytes"] // 2
        if any(sent != half for sent in yours["sent"]):
            raise AssertionError(
                f"rank {rank}: your hook handed {yours['sent']} bytes to "
                "dist.all_reduce per step; "
                f"fp16 is {half} (fp32 {yours['fp32_bytes']}). Call "
                "dist.all_reduce on the fp16 tensor"
            )
    passed(
        f"your hook matches fp16_compress_hook to {TOLERANCE:.0e} over {STEPS} steps, "
        f"sending {half} bytes a step, half of fp32"
    )
