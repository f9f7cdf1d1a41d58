"""The DataParallel chapter's experiments: each variant trained on the same batches, one
step's phases timed, and which threads run the replicas' backward; the bytes GPU 0 moves
(``dataparallel_traffic``), what DDP broadcasts at each forward
(``ddp_buffer_broadcasts``, on every rank of ``run_ranks(..., init_group=False)``), and
the pitfalls the CPU can show.

    # from-scratch DataParallel, 2 replicas
    train_steps("dp-scratch", preset_name="tiny", steps=5)

The variants (``STRATEGIES``, names from ``distlab.infra.experiment``), all in one
process on the same global batches as lab 1: ``single`` (the module alone), ``dp``
(``nn.DataParallel``; with no GPU it calls the module once on the whole batch),
``dp-scratch`` (``ScratchDataParallel``, one thread per replica),
``dp-scratch-1-intra-op`` (the same with one intra-op thread) and
``dp-scratch-no-threads`` (the same replicas one after the other: the difference from
``dp-scratch`` is what the threads overlapped).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.data import token_data
from distlab.infra.experiment import WrapOptions, gpt, train
from distlab.model import preset
from distlab.runtime import init_distributed, pick_device, rank_world
from distlab.scratch.data_parallel import (
    Span,
    gather,
    replica_devices,
    replicate,
    scatter,
)

STRATEGIES = (
    "single",
    "dp",
    "dp-scratch",
    "dp-scratch-1-intra-op",
    "dp-scratch-no-threads",
)


def train_steps(
    strategy: str,
    preset_name: str = "tiny",
    steps: int = 10,
    global_batch: int = 16,
    seed: int = 1337,
    replicas: int = 2,
) -> dict:
    """``experiment.train`` plus the last step's phases as ``Span``s, in seconds from
    its start: the wrapper's own (scatter, replicate, threads, gather; each replica's
    forward) and the harness's backward and optimizer."""
    trace: list[Span] = []
    result = train(
        strategy,
        preset_name,
        steps,
        global_batch,
        seed,
        options=WrapOptions(replicas=replicas, trace=trace),
    )
    last = result.pop("last_step")
    spans = [
        *trace,
        *(Span("main", phase, *last[phase]) for phase in ("backward", "optimizer")),
    ]
    return {
        **result,
        "spans": [
            Span(s.lane, s.phase, s.start - last["start"], s.end - last["start"])
            for s in spans
        ],
    }


def backward_threads(
    preset_name: str = "tiny", global_batch: int = 8, replicas: int = 2
) -> dict[int, set[str]]:
    """The names of the threads that run each replica's backward (on this
    process's device)."""
    device = pick_device("auto")
    model = gpt(preset_name).to(device)
    x, y = token_data().batch(
        "train", 0, global_batch, preset(preset_name).block_size, 0, 0, 1, device
    )
    devices = replica_devices(device, replicas)
    chunks = scatter((x, y), devices)
    copies = replicate(model, devices)
    seen: dict[int, set[str]] = {i: set() for i in range(len(copies))}
    for i, replica in enumerate(copies):
        for p in replica.parameters():
            p.register_hook(
                lambda grad, i=i: seen[i].add(threading.current_thread().name)
            )
    outputs = [replica(*chunk) for replica, chunk in zip(copies, chunks)]
    gather(outputs, devices[0])[1].mean().backward()
    return seen


def thread_speedup(work, n_threads: int = 2, repeats: int = 3) -> float:
    """How much faster ``n_threads`` threads each running ``work()`` finish than the
    same ``n_threads`` calls one after the other (best of ``repeats``): 1.0 means
    no overlap."""

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

    return min(in_a_row() for _ in range(repeats)) / min(
        in_threads() for _ in range(repeats)
    )


# --- begin traffic ---
def dataparallel_traffic(
    params: int, batch: int, seq: int, vocab: int, gpus: int, logits_to_gpu0: bool
) -> dict:
    """Bytes per step (fp32) that GPU 0 of ``nn.DataParallel`` sends and receives, next
    to what DDP's ring all-reduce sends and receives on every GPU. ``logits_to_gpu0``:
    the module returns its logits and the loss is computed on GPU 0; otherwise it
    returns only its loss (N scalars). The batch starts on the CPU: each GPU receives
    its own rows from the host, not from GPU 0."""
    grads = 4 * params
    # the share of the batch (and of its logits) on the other GPUs
    others = (gpus - 1) / gpus
    logits = others * 4 * batch * seq * vocab if logits_to_gpu0 else 0.0
    return {
        # replicate: one NCCL broadcast, pipelined along a chain, so GPU 0 sends each
        # byte once; the loss's backward then scatters the other GPUs' slices of the
        # logits' gradient back
        "DataParallel GPU 0 sends": grads + logits,
        # the replicas' logits gathered onto GPU 0; the gradients summed there by one
        # NCCL reduce
        "DataParallel GPU 0 receives": grads + logits,
        # ring all-reduce: 2(N-1)/N of the gradient each way
        "DDP each GPU sends": 2 * others * grads,
        "DDP each GPU receives": 2 * others * grads,
    }


# --- end traffic ---


# ----------------------------------------------------------- pitfalls, shown on the CPU
def used_gpus(rows: int, gpus: int) -> list[int]:
    """Rows each GPU gets from a batch of ``rows``: torch.chunk's split, as torch's
    scatter cuts. Fewer chunks than GPUs leaves the rest idle (DataParallel replicates
    onto ``device_ids[:chunks]``)."""
    return [len(chunk) for chunk in torch.arange(rows).chunk(gpus)]


def replica_attribute_update() -> dict[str, int]:
    """A counter a module increments in forward, after one forward of its DataParallel
    replica (``Module._replicate_for_data_parallel``, the per-module copy torch's
    replicate makes)."""

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x

    original = Counted()
    replica = original._replicate_for_data_parallel()
    replica(torch.ones(1))
    return {"replica.calls": replica.calls, "original.calls": original.calls}


def autocast_dtype_in_a_thread(
    device_type: str = "cpu", dtype: torch.dtype = torch.float16
) -> dict[str, str]:
    """The dtype of a matmul under ``torch.autocast(device_type, dtype=dtype)``: in the
    calling thread, and in a new thread that re-enters autocast as torch's
    parallel_apply does (on, no dtype)."""
    a, seen = torch.randn(4, 4, device=device_type), {}

    def replica_thread():
        # parallel_apply: autocast(device_type, enabled=...)
        with torch.autocast(device_type, enabled=True):
            seen["replica thread"] = str((a @ a).dtype)

    with torch.autocast(device_type, dtype=dtype):
        seen["calling thread"] = str((a @ a).dtype)
        thread = threading.Thread(target=replica_thread)
        thread.start()
        thread.join()
    return seen


def unpacked_lengths(
    lengths: list[int], gpus: int, total_length: int | None = None
) -> list[tuple[int, ...]]:
    """Shapes of what each replica returns from pack -> GRU -> unpack on its chunk of
    sequences (sorted longest first), with ``pad_packed_sequence(total_length=...)`` or
    without it."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    gru = nn.GRU(3, 4, batch_first=True)
    x, lengths = torch.randn(len(lengths), max(lengths), 3), torch.tensor(lengths)
    shapes = []
    # what scatter gives each replica
    for rows, n in zip(x.chunk(gpus), lengths.chunk(gpus)):
        out, _ = gru(pack_padded_sequence(rows, n, batch_first=True))
        shapes.append(
            tuple(
                pad_packed_sequence(out, batch_first=True, total_length=total_length)[
                    0
                ].shape
            )
        )
    return shapes


# --- begin buffer_sync ---
class RankCounter(nn.Module):
    """A linear layer, and a buffer that every forward changes differently on every rank
    (rank r adds r + 1)."""

    def __init__(self, buffer_numel: int = 5):
        super().__init__()
        self.linear = nn.Linear(2, 1)
        # 5 numbers: its broadcasts are easy to spot
        self.register_buffer("seen", torch.zeros(buffer_numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += rank_world()[0] + 1
        return self.linear(x)


FORWARDS = ("train",) * 3 + ("no_grad",) * 2 + ("train",) * 2 + ("no_sync", "train")


def ddp_buffer_broadcasts(
    forwards: tuple[str, ...] = FORWARDS,
) -> dict[str, list[dict]]:
    """On every rank: DDP around ``RankCounter``, built, then run for ``forwards`` (a
    training step; a forward under ``no_grad``; a training step inside ``no_sync()``),
    with ``forward_sync_buffers`` on (the default) and off. For the construction and
    each forward: the broadcasts the process group ran, those that carried the buffer
    alone, and this rank's buffer."""
    # gloo's flight recorder, read when the group is made
    os.environ["TORCH_FR_BUFFER_SIZE"] = "1000"
    init_distributed(torch.device("cpu"), timeout_s=60)
    try:
        return {
            f"forward_sync_buffers={sync}": _count_broadcasts(sync, forwards)
            for sync in (True, False)
        }
    finally:
        # free every DDP model while its group lives: one freed after the group is
        # destroyed can deadlock gloo (the debugging chapter's "exit order")
        gc.collect()
        dist.destroy_process_group()


def _count_broadcasts(sync: bool, forwards: tuple[str, ...]) -> list[dict]:
    # imports torch._dynamo: seconds
    from torch.nn.parallel import DistributedDataParallel as DDP

    rows, done = [], len(_recorded())
    model = DDP(RankCounter(), forward_sync_buffers=sync)
    for kind in ("construction", *forwards):
        if kind != "construction":
            with model.no_sync() if kind == "no_sync" else contextlib.nullcontext():
                with torch.set_grad_enabled(kind != "no_grad"):
                    out = model(torch.ones(4, 2)).sum()
                    if kind != "no_grad":
                        out.backward()
        new, done = _recorded()[done:], len(_recorded())
        broadcasts = [sizes for op, sizes in new if op.endswith("broadcast")]
        alone = broadcasts.count([[model.module.seen.numel()]])
        rows.append(
            {
                "call": kind,
                "broadcasts": len(broadcasts),
                "of the buffer": alone,
                "buffer": model.module.seen[0].item(),
            }
        )
    return rows


def _recorded() -> list[tuple[str, list]]:
    """(operation, input sizes) of every collective this process's gloo group has run,
    oldest first."""
    trace = pickle.loads(
        torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False)
    )
    return [(e["profiling_name"], e["input_sizes"]) for e in trace["entries"]]


# --- end buffer_sync ---
