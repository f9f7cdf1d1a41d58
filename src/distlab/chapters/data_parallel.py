"""The DataParallel chapter's experiments: the rebuild against the plain module
(``compare_with_plain``), each variant trained on the same batches with one step's
phases timed, which threads run the replicas' backward, the recorded comparison drawn
with its spread (``bench_figure``, ``bench_verdicts``), the bytes GPU 0 moves
(``dataparallel_traffic``), and the pitfalls the CPU can show.

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

import statistics
import threading

import torch
import torch.nn as nn

from distlab.data import token_data
from distlab.infra.claims import compare, spread
from distlab.infra.experiment import WrapOptions, gpt, train
from distlab.model import GPT, preset
from distlab.runtime import pick_device
from distlab.scratch.data_parallel import (
    ScratchDataParallel,
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


def compare_with_plain(rows: int, replicas: int = 2) -> dict:
    """Max |difference| of logits and gradients, plain ``tiny`` GPT against
    ScratchDataParallel on the same ``rows`` sequences, and the two ways to average the
    replicas' losses."""
    data = token_data()
    x, y = data.batch(
        "train", 0, rows, preset("tiny").block_size, 0, 0, 1, torch.device("cpu")
    )
    plain, wrapped = (
        GPT(preset("tiny", vocab_size=data.tokenizer.vocab_size), seed=0)
        for _ in range(2)
    )
    ref_logits, ref_loss = plain(x, y)
    ref_loss.backward()
    logits, losses = ScratchDataParallel(wrapped, [torch.device("cpu")] * replicas)(
        x, y
    )
    losses.mean().backward()
    chunk_rows = [len(c) for c in x.chunk(replicas)]
    # each replica's mean loss weighted by its rows: the plain module's loss
    weighted = sum(n * loss for n, loss in zip(chunk_rows, losses)) / rows
    return {
        "chunk rows": chunk_rows,
        "logits": (logits - ref_logits).abs().max().item(),
        "grads": max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(plain.parameters(), wrapped.parameters())
        ),
        "plain loss": ref_loss.item(),
        "losses.mean()": losses.mean().item(),
        "row-weighted": weighted.item(),
    }


# ------------------------------------------------ the recorded comparison (bench.dp)
def timed_steps(runs: dict, warmup: int) -> dict[str, list[float]]:
    """Each variant's step seconds after the warm-up steps."""
    return {name: r["step_s"][warmup:] for name, r in runs.items()}


def bench_verdicts(runs: dict, warmup: int) -> dict[str, str]:
    """Each variant's steps against the plain model's: "larger" or "smaller" only
    when their ranges do not overlap (``distlab.infra.claims.compare``)."""
    steps = timed_steps(runs, warmup)
    return {
        name: compare(spread(s), spread(steps["single"]))
        for name, s in steps.items()
        if name != "single"
    }


def bench_figure(runs: dict, warmup: int, title: str):
    """Every timed step of every variant as a dot, the median as a bar."""
    import matplotlib.pyplot as plt

    steps = timed_steps(runs, warmup)
    names = list(steps)
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(names)))
    for i, name in enumerate(names):
        ax.scatter(steps[name], [i] * len(steps[name]), s=40, alpha=0.6, color="C0")
        median = statistics.median(steps[name])
        ax.plot([median] * 2, [i - 0.3, i + 0.3], color="k", lw=2.5)
    ax.set_yticks(range(len(names)), names, fontsize=12)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (dots: each timed step; bar: median)", fontsize=11)
    ax.set_title(title, fontsize=12)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


PHASE_COLORS = {
    "scatter": "#1f77b4",
    "replicate": "#ff7f0e",
    "threads": "#bbbbbb",
    "forward": "#2ca02c",
    "gather": "#9467bd",
    "backward": "#d62728",
    "optimizer": "#8c564b",
}


def timeline_figure(spans: list[Span], title: str):
    """One step's phases on the main thread and the replicas' threads."""
    import matplotlib.pyplot as plt

    lanes = ["main", "thread 0", "thread 1"]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    for s in spans:
        label = "waits for threads" if s.phase == "threads" else s.phase
        ax.barh(
            lanes.index(s.lane),
            (s.end - s.start) * 1e3,
            left=s.start * 1e3,
            height=0.5,
            color=PHASE_COLORS[s.phase.split()[0]],
            label=label,
        )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(
        unique.values(),
        unique.keys(),
        ncol=4,
        fontsize=10,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35),
    )
    ax.set_yticks(range(3), ["main thread", "replica 0", "replica 1"], fontsize=11)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began", fontsize=11)
    ax.set_title(title, fontsize=12)
    return fig


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
