"""``nn.DataParallel`` from scratch: one process, a replica per device, a thread
per replica.

One forward of ``ScratchDataParallel`` makes the same four calls as ``nn.DataParallel``
(``torch.nn.parallel`` has the real ones, which refuse CPU tensors):

    inputs   = scatter(batch, devices)           # 1. split the batch along dim 0
    replicas = replicate(module, devices)        # 2. copy the module, at every step
    outputs  = parallel_apply(replicas, inputs)  # 3. one Python thread per replica
    output   = gather(outputs, devices[0])       # 4. concatenate onto the first device

Backward needs no code of its own: a replica's parameters are differentiable copies of
the original parameters, so autograd sums every replica's gradient into the original
``.grad``. The devices may all be the CPU (replicas then share the cores) or
several GPUs.

    dp = ScratchDataParallel(model, [torch.device("cpu")] * 2)
    logits, losses = dp(x, y)      # losses: one mean loss per replica
    losses.mean().backward()       # gradients land in model.parameters()
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class Span:
    """One timed piece of a step: what ran, on which thread, from when to
    when (seconds)."""

    lane: str
    phase: str
    start: float
    end: float


@contextmanager
def _timed(trace: list[Span] | None, lane: str, phase: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        if trace is not None:
            trace.append(Span(lane, phase, start, time.perf_counter()))


def replica_devices(device: torch.device, n: int) -> list[torch.device]:
    """``n`` devices for the replicas: the CPU ``n`` times (replicas share its cores),
    or GPUs 0..n-1."""
    return (
        [device] * n
        if device.type == "cpu"
        else [torch.device(device.type, i) for i in range(n)]
    )


def scatter(
    inputs: tuple[torch.Tensor, ...], devices: list[torch.device]
) -> list[tuple[torch.Tensor, ...]]:
    """Chunk every input along dim 0 and send chunk i to ``devices[i]``.

    Chunks follow ``torch.chunk``, as torch's scatter does: ceil(B / n) rows each, so
    the last chunk can be smaller, and a batch shorter than the device list gives
    fewer chunks.
    """
    chunked = [t.chunk(len(devices)) for t in inputs]
    n = min(len(c) for c in chunked)
    return [tuple(c[i].to(devices[i]) for c in chunked) for i in range(n)]


def replicate(module: nn.Module, devices: list[torch.device]) -> list[nn.Module]:
    """One shallow copy of ``module`` per device, holding differentiable copies of
    its parameters.

    Each module object is copied (a new ``__dict__``, so replicas can run in threads
    without sharing state), and each parameter becomes ``p.to(device, copy=True)``: a
    new tensor whose gradient autograd routes back to ``p`` (a frozen one's copy needs
    no gradient and gets none). Tied parameters are copied once, so they stay tied.
    Buffers, as in torch's ``replicate``: the first replica uses the original's, so its
    in-place updates (BatchNorm's running statistics, from its chunk of the batch) are
    kept; the others get copies, thrown away.
    """
    return [_replica(module, device, first=i == 0) for i, device in enumerate(devices)]


def _replica(module: nn.Module, device: torch.device, first: bool) -> nn.Module:
    # dedups tied weights
    params = {p: p.to(device, copy=True) for p in module.parameters()}
    # .to(device) alone returns the original when it is already there: with every
    # replica on the CPU, all threads would update the same running statistics at once
    buffers = {b: b.to(device, copy=not first) for b in module.buffers()}
    copies = {}
    for m in module.modules():
        copy = m.__new__(type(m))
        copy.__dict__ = m.__dict__.copy()
        copies[m] = copy
    for m, copy in copies.items():
        copy._modules = {
            k: None if v is None else copies[v] for k, v in m._modules.items()
        }
        copy._parameters = {
            k: None if p is None else params[p] for k, p in m._parameters.items()
        }
        copy._buffers = {
            k: None if b is None else buffers[b] for k, b in m._buffers.items()
        }
    return copies[module]


def parallel_apply(
    replicas: list[nn.Module], inputs: list[tuple], trace: list[Span] | None = None
) -> list:
    """Run ``replicas[i](*inputs[i])`` in one thread each; return the outputs in order.

    Grad mode and autocast are thread-local in PyTorch, so each thread re-enters the
    caller's, autocast's dtype included. (torch's ``parallel_apply`` re-enters grad
    mode and autocast's on/off switch, not its dtype: a replica thread computes in the
    device's default autocast dtype.) An exception in a thread is raised here.
    """
    grad_enabled = torch.is_grad_enabled()
    device_type = inputs[0][0].device.type
    autocast = dict(
        device_type=device_type,
        enabled=torch.is_autocast_enabled(device_type),
        dtype=torch.get_autocast_dtype(device_type),
    )
    results: list = [None] * len(replicas)

    def work(i: int) -> None:
        try:
            with (
                torch.set_grad_enabled(grad_enabled),
                torch.autocast(**autocast),
                _timed(trace, f"thread {i}", "forward"),
            ):
                results[i] = replicas[i](*inputs[i])
        except BaseException as e:  # re-raised by the caller, with the replica named
            results[i] = e

    threads = [
        threading.Thread(target=work, args=(i,), name=f"replica-{i}")
        for i in range(len(replicas))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            raise RuntimeError(f"replica {i} failed: {type(r).__name__}: {r}") from r
    return results


def gather(outputs: list, device: torch.device):
    """Concatenate the replicas' outputs along dim 0 on ``device``, element by element.

    Scalars (a replica's mean loss) cannot be concatenated; like torch's gather, they
    are stacked into a vector with one entry per replica, which the caller reduces.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        moved = [o.to(device) for o in outputs]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved)
    if first is None:
        return None
    return type(first)(
        gather([o[i] for o in outputs], device) for i in range(len(first))
    )


class ScratchDataParallel(nn.Module):
    """``nn.DataParallel`` rebuilt from ``scatter``, ``replicate``,
    ``parallel_apply``, ``gather``.

    ``module`` must live on ``devices[0]``; the optimizer steps ``module.parameters()``.
    Set ``trace`` to a list to record a ``Span`` for each phase of the next forwards.
    """

    def __init__(self, module: nn.Module, devices: list[torch.device]):
        super().__init__()
        if not devices:
            raise ValueError("ScratchDataParallel needs at least one device")
        self.module = module
        self.devices = [torch.device(d) for d in devices]
        self.trace: list[Span] | None = None

    def apply(self, replicas: list[nn.Module], chunks: list[tuple]) -> list:
        return parallel_apply(replicas, chunks, self.trace)

    def forward(self, *inputs: torch.Tensor):
        with _timed(self.trace, "main", "scatter"):
            chunks = scatter(inputs, self.devices)
        if len(chunks) == 1:  # one device (or a one-row batch): nothing to parallelise
            return self.module(*chunks[0])
        with _timed(self.trace, "main", "replicate"):
            replicas = replicate(self.module, self.devices[: len(chunks)])
        with _timed(self.trace, "main", "threads"):
            outputs = self.apply(replicas, chunks)
        with _timed(self.trace, "main", "gather"):
            return gather(outputs, self.devices[0])


class SequentialDataParallel(ScratchDataParallel):
    """``ScratchDataParallel`` with the replicas run one after the other in the caller's
    thread: what is left of a step when the threads overlap nothing."""

    def apply(self, replicas: list[nn.Module], chunks: list[tuple]) -> list:
        outputs = []
        for i, (replica, chunk) in enumerate(zip(replicas, chunks)):
            with _timed(self.trace, "main", f"forward {i}"):
                outputs.append(replica(*chunk))
        return outputs
