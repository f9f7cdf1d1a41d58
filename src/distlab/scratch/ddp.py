"""DistributedDataParallel rebuilt from scratch, in three steps.

Each wrapper is used like torch's DDP, plus one call after ``loss.backward()``:

    model = BucketedDDP(model)           # or NaiveDDP / HookDDP
    loss = model(x, y)[1]
    loss.backward()
    model.finish_gradient_sync()         # every rank now holds the averaged gradients
    optimizer.step()

(a) NaiveDDP: broadcast rank 0's parameters once; after backward, all-reduce every
    gradient, one at a time. Correct, and slow: communication starts only after the
    whole backward pass, one small message per tensor.
(b) HookDDP: a hook on every parameter all-reduces its gradient the moment autograd has
    finished accumulating it, during the backward pass.
(c) BucketedDDP: gradients are packed into ~25 MB buckets (the first one 1 MB) in reverse
    parameter order (roughly the order backward produces them); a full bucket is all-reduced
    asynchronously while backward goes on, and we wait only before the optimizer step.
    This is what torch DDP's C++ Reducer does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class _DataParallelBase(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        # every rank must start from the same weights: rank 0's win
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self) -> None:
        raise NotImplementedError


# --- begin naive ---
class NaiveDDP(_DataParallelBase):
    """(a) After backward: all-reduce each gradient, then divide by the world size."""

    def finish_gradient_sync(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)  # sum over ranks
                p.grad.div_(self.world_size)  # ... and the sum of means / N is the global mean


# --- end naive ---


# --- begin hooks ---
class HookDDP(_DataParallelBase):
    """(b) A hook per parameter all-reduces its gradient as soon as it is complete."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        for p in module.parameters():  # a tied matrix is one parameter: one hook, one reduce
            p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p: torch.Tensor) -> None:
        # runs inside backward, after autograd has summed every use of p into p.grad
        dist.all_reduce(p.grad)
        p.grad.div_(self.world_size)

    def finish_gradient_sync(self) -> None:
        pass  # nothing left: every hook already reduced its gradient


# --- end hooks ---


# --- begin buckets ---
class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.offsets = {}  # parameter -> where its gradient lives in the flat buffer
        start = 0
        for p in params:
            self.offsets[p] = (start, start + p.numel())
            start += p.numel()
        self.pending = len(params)
        self.work = None  # the in-flight async all-reduce


class BucketedDDP(_DataParallelBase):
    """(c) Buckets in reverse order, each all-reduced asynchronously once it is full."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0):
        super().__init__(module)
        params = [p for p in module.parameters() if p.requires_grad]
        # as torch DDP does: a small first bucket, so communication starts early in backward
        cap = min(first_bucket_mb, bucket_cap_mb) * 2**20
        self.buckets: list[_Bucket] = []
        current, size = [], 0
        for p in reversed(params):  # backward meets the last layers first
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(_Bucket(current))
                current, size, cap = [], 0, bucket_cap_mb * 2**20
        if current:
            self.buckets.append(_Bucket(current))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p: torch.Tensor) -> None:
        bucket = self.bucket_of[p]
        start, end = bucket.offsets[p]
        bucket.buffer[start:end].copy_(p.grad.view(-1))
        bucket.pending -= 1
        # launch in bucket order on every rank: collectives pair up by order, not by name,
        # so a rank launching bucket 2 before bucket 1 would sum the wrong tensors together
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending == 0:
            ready = self.buckets[self.next_to_launch]
            ready.work = dist.all_reduce(ready.buffer, async_op=True)  # overlaps with backward
            self.next_to_launch += 1

    def finish_gradient_sync(self) -> None:
        if self.next_to_launch < len(self.buckets):
            missing = [p.shape for b in self.buckets for p in b.params if p.grad is None]
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient this step (shapes "
                f"{missing[:3]}): an unused parameter stalls its bucket forever; "
                "torch DDP's find_unused_parameters=True exists for this"
            )
        for bucket in self.buckets:
            bucket.work.wait()  # the only point where backward waits for the network
            bucket.buffer.div_(self.world_size)
            for p in bucket.params:
                start, end = bucket.offsets[p]
                p.grad.copy_(bucket.buffer[start:end].view_as(p.grad))
            bucket.pending, bucket.work = len(bucket.params), None
        self.next_to_launch = 0


# --- end buckets ---
