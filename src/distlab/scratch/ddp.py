"""DistributedDataParallel rebuilt from scratch, in three steps.

Each wrapper is used like torch's DDP, plus one call after ``loss.backward()``:

    model = BucketedDDP(model)           # or NaiveDDP / HookDDP
    loss = model(x, y)[1]
    loss.backward()
    model.finish_gradient_sync()         # every rank now holds the averaged gradients
    optimizer.step()

Torch's DDP needs no such call: its C++ Reducer queues a callback on the autograd engine
when it launches its last bucket, and the engine runs it before ``backward()`` returns;
it waits for the buckets there (Reducer::finalize_backward in
torch/csrc/distributed/c10d/reducer.cpp).

(a) NaiveDDP: broadcast rank 0's parameters once; after backward, all-reduce every
    gradient, one at a time. Correct, and slow: communication starts only after the
    whole backward pass, one small message per tensor.
(b) HookDDP: a hook on every parameter all-reduces its gradient the moment autograd has
    finished accumulating it, during the backward pass.
(c) BucketedDDP: gradients are packed into ~25 MiB buckets (the first one 1 MiB) in
    reverse parameter order (roughly the order backward produces them); a full bucket is
    all-reduced asynchronously while backward goes on, and we wait only before the
    optimizer step. Torch DDP's C++ Reducer launches its buckets the same way, but lays
    them out otherwise: one bucket holding every parameter for the first iteration,
    then, at the second forward, buckets cut once from the order in which the gradients
    really became ready, with the 1 MiB first bucket only when bucket_cap_mb is not
    passed (torch/nn/parallel/distributed.py, _BucketCapacityConfig). BucketedDDP fixes
    its layout at construction from reversed parameters(), and its first bucket is 1 MiB
    (or bucket_cap_mb, if smaller) whether bucket_cap_mb is passed or not. Both keep
    one dtype per bucket: a model with fp32 and bf16 parameters fills buckets of each
    dtype apart, each with its own small first one (compute_bucket_assignment_by_size
    in torch/csrc/distributed/c10d/reducer.cpp keys its buckets by dtype and device).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class _DataParallelBase(nn.Module):
    def __init__(self, module: nn.Module, forward_sync_buffers: bool = True):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        # the gradients to average: a frozen parameter (requires_grad=False) has none,
        # and a tied one appears once in module.parameters(), as torch DDP's Reducer
        # sees them
        self.params = [p for p in module.parameters() if p.requires_grad]
        # every rank must start from the same weights (frozen ones too) and buffers:
        # rank 0's win
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.forward_sync_buffers = forward_sync_buffers
        self._sync_buffers_next = True

    def forward(self, *args, **kwargs):
        # as torch DDP by default: rank 0's buffers (BatchNorm's running statistics,
        # which each rank updates from its own rows) overwrite the others' before a
        # forward, when the previous forward ran with grad mode on
        # (torch/nn/parallel/distributed.py: will_sync_module_buffers,
        # require_forward_param_sync)
        if self.forward_sync_buffers and self._sync_buffers_next:
            with torch.no_grad():
                for buffer in self.module.buffers():
                    dist.broadcast(buffer, src=0)
        self._sync_buffers_next = torch.is_grad_enabled()
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self) -> None:
        raise NotImplementedError


# --- begin naive ---
def on_any_rank(params: list[torch.Tensor], flags: list[bool]) -> list[bool]:
    """One flag per parameter, OR-ed over the ranks with one small all-reduce: the same
    answer everywhere (torch DDP's Reducer all-reduces such a "local used map" of which
    parameters got a gradient when find_unused_parameters=True)."""
    if not params:
        return []
    anywhere = torch.tensor(flags, dtype=torch.int32, device=params[0].device)
    dist.all_reduce(anywhere)
    return anywhere.bool().tolist()


class NaiveDDP(_DataParallelBase):
    """(a) After backward: all-reduce each gradient, then divide by the world size."""

    def finish_gradient_sync(self) -> None:
        # every rank must issue the same all-reduces, also for a parameter that only
        # some ranks' rows reached (a branch taken by some batches): so first agree on
        # which got a gradient
        reached_anywhere = on_any_rank(
            self.params, [p.grad is not None for p in self.params]
        )
        for p, reached in zip(self.params, reached_anywhere):
            if not reached:
                continue  # no rank's rows used p: .grad stays None, as in one process
            if p.grad is None:
                # this rank's rows did not use p: they add 0
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)  # sum over ranks
            # ... and the sum of means / N is the global mean
            p.grad.div_(self.world_size)


# --- end naive ---


# --- begin hooks ---
class HookDDP(_DataParallelBase):
    """(b) A hook per parameter all-reduces its gradient as soon as it is complete.

    The ranks' all-reduces pair up in the order the hooks fire, so every rank must
    finish the same gradients in the same order. A parameter no rank uses fires no hook
    and keeps .grad None; one that only some ranks use (a data-dependent branch) makes
    the ranks pair different tensors: torch DDP fails there too, unless given
    find_unused_parameters=True.
    """

    def __init__(self, module: nn.Module, **options):
        super().__init__(module, **options)
        # a frozen tensor cannot take a hook; a tied one is hooked once
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p: torch.Tensor) -> None:
        # runs inside backward, after autograd has summed every use of p into p.grad
        dist.all_reduce(p.grad)
        p.grad.div_(self.world_size)

    def finish_gradient_sync(self) -> None:
        pass  # nothing left: every hook already reduced its gradient


# --- end hooks ---


# --- begin bucketing ---
def assign_buckets(
    params: list[nn.Parameter], first_cap: float, cap: float
) -> list[list[nn.Parameter]]:
    """Cut ``params``, in the order backward should finish them, into buckets as torch's
    ``compute_bucket_assignment_by_size`` does: a bucket closes at the first gradient
    that takes it to its cap (in bytes) or past it; ``first_cap`` for the first."""
    closed, filling = [], {}  # (dtype, device) -> its open bucket: params, bytes, cap
    for p in params:
        # a flat buffer has one dtype: an fp32 gradient in a bf16 bucket would be
        # rounded, so each dtype (and device) fills buckets of its own
        key = (p.dtype, p.device)
        members, size, limit = filling.get(key, ([], 0, first_cap))
        members, size = [*members, p], size + p.numel() * p.element_size()
        if size >= limit:
            closed.append(members)
            members, size, limit = [], 0, cap
        filling[key] = (members, size, limit)
    # the buckets still filling go last (torch's order among them is its hash map's)
    return closed + [members for members, _, _ in filling.values() if members]


# --- end bucketing ---


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        # one dtype and device per bucket (assign_buckets)
        self.buffer = torch.zeros(
            sum(p.numel() for p in params),
            dtype=params[0].dtype,
            device=params[0].device,
        )
        self.offsets = {}  # parameter -> where its gradient lives in the flat buffer
        start = 0
        for p in params:
            self.offsets[p] = (start, start + p.numel())
            start += p.numel()
        self.pending = len(params)
        self.work = None  # the in-flight async all-reduce


class BucketedDDP(_DataParallelBase):
    """(c) Buckets in reverse order, each all-reduced asynchronously once it is full.

    ``find_unused_parameters=True`` (torch DDP's flag) admits parameters that get no
    gradient on some ranks or on all: they count as ready, with a zero gradient, in
    ``finish_gradient_sync``, and one that no rank used keeps ``.grad`` None. Torch
    finds them earlier, walking the autograd graph after forward, and marks them ready
    when backward's first gradient arrives (``Reducer::autograd_hook`` in
    torch/csrc/distributed/c10d/reducer.cpp), so their buckets still overlap
    with backward.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        find_unused_parameters: bool = False,
        **options,
    ):
        super().__init__(module, **options)
        self.find_unused_parameters = find_unused_parameters
        # a small first bucket, so communication starts early in backward (torch DDP has
        # one too, from its second iteration, and only when bucket_cap_mb is not passed)
        first = min(first_bucket_mb, bucket_cap_mb) * 2**20
        # backward meets the last layers first
        order = list(reversed(self.params))
        self.buckets = [
            _Bucket(ps) for ps in assign_buckets(order, first, bucket_cap_mb * 2**20)
        ]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        # parameters whose gradient this backward produced
        self.arrived: set[torch.Tensor] = set()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p: torch.Tensor) -> None:
        # torch DDP stops too: "Expected to mark a variable ready only once"
        if p in self.arrived:
            raise RuntimeError(
                f"the gradient of a parameter of shape {tuple(p.shape)} arrived "
                "twice before "
                "finish_gradient_sync(): call it after every backward (a second "
                "backward, or a "
                "parameter used in two reentrant-checkpointed segments, fires "
                "its hook twice)"
            )
        self.arrived.add(p)
        self._into_bucket(p, p.grad)

    def _into_bucket(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        bucket = self.bucket_of[p]
        start, end = bucket.offsets[p]
        bucket.buffer[start:end].copy_(grad.reshape(-1))
        bucket.pending -= 1
        # launch in bucket order on every rank: collectives pair up by order, not by
        # name, so a rank launching bucket 2 before bucket 1 would sum the wrong
        # tensors together
        while (
            self.next_to_launch < len(self.buckets)
            and self.buckets[self.next_to_launch].pending == 0
        ):
            ready = self.buckets[self.next_to_launch]
            # overlaps with backward
            ready.work = dist.all_reduce(ready.buffer, async_op=True)
            self.next_to_launch += 1

    def finish_gradient_sync(self) -> None:
        missing = [p for p in self.params if p not in self.arrived]
        if missing and not self.find_unused_parameters:
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient this step (shapes "
                f"{[tuple(p.shape) for p in missing[:3]]}): an unused parameter "
                "stalls its bucket "
                "forever. torch DDP stops too (at the next forward) unless given "
                "find_unused_parameters=True; BucketedDDP takes the same flag"
            )
        # unused on this rank: it adds its .grad if it has one (zero_grad's zeros),
        # else 0
        for p in missing:
            self._into_bucket(p, p.grad if p.grad is not None else torch.zeros_like(p))
        # every bucket is launched now, in order; then, as torch does, which ones some
        # rank used
        used = {}
        if self.find_unused_parameters:
            used = dict(
                zip(
                    self.params,
                    on_any_rank(self.params, [p in self.arrived for p in self.params]),
                )
            )
        for bucket in self.buckets:
            # the one wait (torch DDP's is inside backward(), in an engine callback)
            bucket.work.wait()
            bucket.buffer.div_(self.world_size)
            for p in bucket.params:
                if not used.get(p, True):
                    continue  # no rank used p: leave .grad as it was, as torch DDP does
                start, end = bucket.offsets[p]
                average = bucket.buffer[start:end].view_as(p)
                if p.grad is None:
                    p.grad = average.clone()
                else:
                    p.grad.copy_(average)
            bucket.pending, bucket.work = len(bucket.params), None
        self.next_to_launch = 0
        self.arrived.clear()
