"""Train the GPT with DataParallel variants in this process, timing each phase of a step.

    train_steps("scratch", preset_name="tiny", steps=5)   # from-scratch DataParallel, 2 replicas

Kinds (all in one process, on the same global batches as lab 1 and ``ddp_compare``):
``plain`` (the module alone), ``nn.DataParallel`` (torch's wrapper; with no GPU it calls
the module once on the whole batch), ``scratch`` (``ScratchDataParallel``, one thread per
replica) and ``scratch, no threads`` (the same replicas run one after the other: the
difference from ``scratch`` is what the threads overlapped).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
import torch.nn as nn

from distlab.data import TokenData, load_corpus
from distlab.model import GPT, preset
from distlab.runtime import pick_device, synchronize
from distlab.scratch.data_parallel import ScratchDataParallel, Span, _timed, gather, replica_devices, replicate, scatter

KINDS = ("plain", "nn.DataParallel", "scratch", "scratch, no threads")


class _SequentialDataParallel(ScratchDataParallel):
    """``ScratchDataParallel`` with the replicas run one after the other in the caller's thread."""

    def apply(self, replicas, chunks):
        outputs = []
        for i, (replica, chunk) in enumerate(zip(replicas, chunks)):
            with _timed(self.trace, "main", f"forward {i}"):
                outputs.append(replica(*chunk))
        return outputs


@contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` intra-op threads (None: leave the setting alone)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def wrap(kind: str, model: nn.Module, device: torch.device, replicas: int) -> nn.Module:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "plain":
        return model
    if kind == "nn.DataParallel":
        return nn.DataParallel(model)  # every visible GPU, or (no GPU) the module itself
    devices = replica_devices(device, replicas)
    cls = ScratchDataParallel if kind == "scratch" else _SequentialDataParallel
    return cls(model, devices)


def train_steps(
    kind: str,
    preset_name: str = "tiny",
    steps: int = 10,
    global_batch: int = 16,
    seed: int = 1337,
    replicas: int = 2,
    lr: float = 1e-3,
    threads: int | None = None,
) -> dict:
    """``steps`` AdamW steps; returns each step's loss and seconds, and the last step's spans.

    ``threads``: intra-op threads for the run (None: as the process has them).
    """
    if steps < 1 or global_batch < 1 or replicas < 1:
        raise ValueError("steps, global_batch and replicas must be positive")
    data = TokenData(load_corpus())
    device = pick_device("auto")
    T = preset(preset_name).block_size
    model = GPT(preset(preset_name, vocab_size=data.tokenizer.vocab_size), seed=seed).to(device)
    wrapped = wrap(kind, model, device, replicas)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses, seconds, trace = [], [], []
    with intra_op_threads(threads):
        for step in range(steps):
            trace.clear()
            if isinstance(wrapped, ScratchDataParallel):
                wrapped.trace = trace
            synchronize(device)
            start = time.perf_counter()
            x, y = data.batch("train", step, global_batch, T, seed, 0, 1, device)
            _, loss = wrapped(x, y)
            loss = loss.mean()  # one loss per replica from DataParallel; a no-op on a scalar
            with _timed(trace, "main", "backward"):
                loss.backward()
            with _timed(trace, "main", "optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            synchronize(device)
            seconds.append(time.perf_counter() - start)
    timed = seconds[2:] or seconds  # the first two steps warm up allocators and caches
    spans = [Span(s.lane, s.phase, s.start - start, s.end - start) for s in trace]
    return {
        "kind": kind,
        "threads": threads or torch.get_num_threads(),
        "losses": losses,
        "step_s": seconds,
        "tokens_per_s": global_batch * T * len(timed) / sum(timed),
        "spans": spans,
    }


def backward_threads(preset_name: str = "tiny", global_batch: int = 8, replicas: int = 2) -> dict[int, set[str]]:
    """The names of the threads that run each replica's backward (on this process's device)."""
    data = TokenData(load_corpus())
    device = pick_device("auto")
    model = GPT(preset(preset_name, vocab_size=data.tokenizer.vocab_size)).to(device)
    x, y = data.batch("train", 0, global_batch, preset(preset_name).block_size, 0, 0, 1, device)
    devices = replica_devices(device, replicas)
    chunks = scatter((x, y), devices)
    copies = replicate(model, devices)
    seen: dict[int, set[str]] = {i: set() for i in range(len(copies))}
    for i, replica in enumerate(copies):
        for p in replica.parameters():
            p.register_hook(lambda grad, i=i: seen[i].add(threading.current_thread().name))
    outputs = [replica(*chunk) for replica, chunk in zip(copies, chunks)]
    gather(outputs, devices[0])[1].mean().backward()
    return seen


def thread_speedup(work, n_threads: int = 2, repeats: int = 3) -> float:
    """How much faster ``n_threads`` threads each running ``work()`` finish than the same
    ``n_threads`` calls one after the other (best of ``repeats``): 1.0 means no overlap."""

    def in_a_row() -> float:
        start = time.perf_counter()
        for _ in range(n_threads):
            work()
        return time.perf_counter() - start

    def in_threads() -> float:
        threads = [threading.Thread(target=work) for _ in range(n_threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    return min(in_a_row() for _ in range(repeats)) / min(in_threads() for _ in range(repeats))
