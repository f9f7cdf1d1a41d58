"""One step of ``ScratchDataParallel``, recorded call by call and drawn.

``record_step`` runs the four calls (scatter, replicate, parallel_apply, gather), the
backward and the optimizer step on a real model and batch, and keeps what each call
did: the rows each device got, the numbers copied, the threads that ran each replica,
the shapes gathered, where the gradients landed. ``step_figure`` draws the record
(the page's key figure); ``step_views`` gives one view per call, for a stepper that
needs no kernel in the built page.

    record = record_step(model, (x, y), [torch.device("cpu")] * 2)
    step_figure(record)
    stepper(step_views(record), "call")
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn

from distlab.scratch.data_parallel import gather, parallel_apply, replicate, scatter

CALLS = ("scatter", "replicate", "parallel_apply", "gather", "backward", "optimizer")
COLORS = {
    "scatter": "#cfe3f7",
    "replicate": "#fde2c4",
    "parallel_apply": "#d8f0d2",
    "gather": "#e6dcf5",
    "backward": "#f7d4d4",
    "optimizer": "#f0f0c8",
}


def _rows(chunks: list[tuple], start: int = 0) -> list[str]:
    spans, first = [], start
    for chunk in chunks:
        spans.append(f"rows {first}-{first + len(chunk[0]) - 1}")
        first += len(chunk[0])
    return spans


def record_step(model: nn.Module, batch: tuple, devices: list[torch.device]) -> dict:
    """Run one DataParallel step of ``model`` on ``batch`` (the model returns
    ``(logits, loss)``); what each call did, per device, as short strings, and the
    numbers behind them."""
    n = len(devices)
    chunks = scatter(batch, devices)
    copies = replicate(model, devices)
    originals = {id(p) for p in model.parameters()}
    copied = [
        sum(p.numel() for p in r.parameters() if id(p) not in originals) for r in copies
    ]
    outputs = parallel_apply(copies, chunks)
    logits, losses = gather(outputs, devices[0])
    # which thread ran each replica's backward, seen from a hook on its first parameter
    ran_backward: dict[int, str] = {}

    def seen(i: int, grad: torch.Tensor) -> None:
        ran_backward[i] = threading.current_thread().name

    for i, r in enumerate(copies):
        next(r.parameters()).register_hook(lambda g, i=i: seen(i, g))
    losses.mean().backward()
    with_grad = sum(p.grad is not None for p in model.parameters())
    shape = "x".join(str(s) for s in logits.shape)
    return {
        "devices": n,
        "rows": [len(c[0]) for c in chunks],
        "params": sum(p.numel() for p in model.parameters()),
        "copied": copied,
        "grad_fn": type(next(copies[1].parameters()).grad_fn).__name__,
        "gathered": tuple(logits.shape),
        "losses": len(losses),
        "backward_threads": [ran_backward[i] for i in range(n)],
        "with_grad": with_grad,
        # one short line per device for each call: what the figure draws
        "cells": {
            "scatter": _rows(chunks),
            "replicate": [f"copy of\n{c / 1e3:.0f}K params" for c in copied],
            "parallel_apply": [f"forward,\nthread {i}" for i in range(n)],
            "gather": [f"logits\n{shape}"] + ["sends its\nlogits"] * (n - 1),
            "backward": ["grads\nsummed here"]
            + [f"replica {i}'s\nbackward" for i in range(1, n)],
            "optimizer": ["step"] + ["replica\ndropped"] * (n - 1),
        },
    }


def step_figure(record: dict, highlight: str | None = None):
    """The step as a grid: one column per call, one row per device. With
    ``highlight``, that call stands out and the others fade."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    n, cols = record["devices"], len(CALLS)
    fig, ax = plt.subplots(figsize=(8.5, 0.9 + 1.25 * n))
    ax.set_xlim(-1.35, cols - 0.5), ax.set_ylim(n - 0.55, -1.0), ax.axis("off")
    for d in range(n):
        ax.text(-1.33, d, f"device {d}", va="center", fontsize=12.5, weight="bold")
    for c, call in enumerate(CALLS):
        alpha = 1.0 if highlight in (None, call) else 0.25
        weight = "bold" if highlight == call else "normal"
        ax.text(
            c,
            -0.38,
            call.replace("_", "_\n"),
            ha="center",
            va="bottom",
            fontsize=12.5,
            weight=weight,
        )
        for d, text in enumerate(record["cells"][call]):
            if not text:
                continue
            ax.add_patch(
                FancyBboxPatch(
                    (c - 0.43, d - 0.3),
                    0.86,
                    0.6,
                    boxstyle="round,pad=0.03",
                    fc=COLORS[call],
                    ec="0.3",
                    alpha=alpha,
                )
            )
            ax.text(c, d, text, ha="center", va="center", fontsize=11.5, alpha=alpha)
        # between the rows: parameters out of device 0, outputs and gradients into it
        down = call == "replicate"
        if call in ("replicate", "gather", "backward"):
            for d in range(1, n):
                a, b = (d - 1 + 0.36, d - 0.36) if down else (d - 0.36, d - 1 + 0.36)
                ax.add_patch(
                    FancyArrowPatch(
                        (c, a),
                        (c, b),
                        arrowstyle="-|>",
                        mutation_scale=16,
                        lw=1.6,
                        color="#b03030" if call == "backward" else "0.25",
                        alpha=alpha,
                    )
                )
    fig.tight_layout()
    return fig


def what_moved(record: dict) -> dict[str, str]:
    """One sentence per call, from the record: what moved, and where."""
    rows, n = record["rows"], record["devices"]
    copied = record["copied"][1] / 1e3
    return {
        "scatter": f"The batch is cut along its rows ({' + '.join(map(str, rows))}),"
        " one chunk per device. From the host each GPU receives its own rows.",
        "replicate": f"Device 0's module is copied to every device: {copied:.0f}K"
        f" numbers per copy, at every step. Each copy is a {record['grad_fn']}"
        " node of autograd, so its gradient flows back to the original.",
        "parallel_apply": f"{n} Python threads of one process each run one replica's"
        " forward on its chunk. One interpreter launches every device's work.",
        "gather": f"The outputs come back to device 0 and are concatenated"
        f" ({'x'.join(map(str, record['gathered']))}). The {record['losses']}"
        " per-replica losses are stacked; the caller averages them.",
        "backward": "Backward runs the same graph in reverse. Each replica's"
        " gradients are summed into the original parameters on device 0 (on GPUs:"
        " one reduce, after the whole backward). Here both replicas' backward ran"
        f" on {', '.join(sorted(set(record['backward_threads'])))}.",
        "optimizer": "The optimizer steps the original module on device 0 only."
        " The replicas are thrown away; the next step replicates again.",
    }


def step_views(record: dict) -> list[tuple]:
    """The calls, one view each (a sentence and the figure with that call lit), for
    ``distlab.infra.stepper``."""
    sentences = what_moved(record)
    return [
        (
            f"<div><b>{i + 1}. {call}</b>: {sentences[call]}</div>",
            step_figure(record, call),
        )
        for i, call in enumerate(CALLS)
    ]
