"""The DataParallel chapter's experiments: each variant trained on the same batches, one
step's phases timed, and which threads run the replicas' backward.

    train_steps("dp-scratch", preset_name="tiny", steps=5)   # from-scratch DataParallel, 2 replicas

The variants (``STRATEGIES``, names from ``distlab.infra.experiment``), all in one process
on the same global batches as lab 1: ``single`` (the module alone), ``dp``
(``nn.DataParallel``; with no GPU it calls the module once on the whole batch),
``dp-scratch`` (``ScratchDataParallel``, one thread per replica), ``dp-scratch-1-intra-op``
(the same with one intra-op thread) and ``dp-scratch-no-threads`` (the same replicas one
after the other: the difference from ``dp-scratch`` is what the threads overlapped).
"""

from __future__ import annotations

import threading
import time

from distlab.data import token_data
from distlab.infra.experiment import WrapOptions, gpt, train
from distlab.model import preset
from distlab.runtime import pick_device
from distlab.scratch.data_parallel import Span, gather, replica_devices, replicate, scatter

STRATEGIES = ("single", "dp", "dp-scratch", "dp-scratch-1-intra-op", "dp-scratch-no-threads")


def train_steps(
    strategy: str,
    preset_name: str = "tiny",
    steps: int = 10,
    global_batch: int = 16,
    seed: int = 1337,
    replicas: int = 2,
) -> dict:
    """``experiment.train`` plus the last step's phases as ``Span``s, in seconds from its start:
    the wrapper's own (scatter, replicate, threads, gather; each replica's forward) and the
    harness's backward and optimizer."""
    trace: list[Span] = []
    result = train(
        strategy, preset_name, steps, global_batch, seed, options=WrapOptions(replicas=replicas, trace=trace)
    )
    last = result.pop("last_step")
    spans = [*trace, *(Span("main", phase, *last[phase]) for phase in ("backward", "optimizer"))]
    return {**result, "spans": [Span(s.lane, s.phase, s.start - last["start"], s.end - last["start"]) for s in spans]}


def backward_threads(preset_name: str = "tiny", global_batch: int = 8, replicas: int = 2) -> dict[int, set[str]]:
    """The names of the threads that run each replica's backward (on this process's device)."""
    device = pick_device("auto")
    model = gpt(preset_name).to(device)
    x, y = token_data().batch("train", 0, global_batch, preset(preset_name).block_size, 0, 0, 1, device)
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
