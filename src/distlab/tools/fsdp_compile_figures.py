"""Figures and readings for book/fsdp_compile.md.

* ``orders_figure``: what Dynamo did in each order of checkpoint, compile and shard,
  drawn as a table from the page's own run (``chapters.fsdp_compile.tour``);
* ``compute_share``: a recorded GPU run (``bench.fsdp_compile``) read against its
  arithmetic: FLOPs per step, achieved FLOP/s, MFU of the datasheet peak, and how long
  the step's FLOPs would take at that peak;
* ``step_figure``: the measured steps beside that time at peak.
"""

from __future__ import annotations

import re

from distlab.flops import DATASHEET_PEAKS, flops_per_token
from distlab.model import preset

FONT = 12  # read on a phone: few labels, large letters
GOOD, BAD, NOTE, NONE = "#b9dcb0", "#f1b6b0", "#f6dca5", "#e6e6e6"

# short names, one line each at phone width
ORDER_LABELS = {
    "eager": "eager (reference)",
    "checkpoint, compile, shard": "ckpt, compile, shard (labs)",
    "checkpoint, compile (replace, fullgraph), shard": (
        "ckpt, torch.compile(block), shard"
    ),
    "checkpoint, shard, compile": "ckpt, shard, compile",
    "checkpoint, shard, compile the whole model": "ckpt, shard, compile(model)",
    "shard blocks, checkpoint, compile, shard root": "shard, ckpt, compile",
    "shard blocks, checkpoint, compile (replace, fullgraph), shard root": (
        "shard, ckpt, compile fullgraph"
    ),
    "compile, checkpoint, shard": "compile, ckpt, shard",
}


def _cells(name: str, run: dict, steps: int) -> list[tuple[str, str]]:
    """(text, colour) per column for one order."""
    if name == "eager":
        return [("-", NONE)] * 3 + [("reference", NONE)]
    if "error" in run:
        return [("-", NONE)] * 3 + [("error", BAD)]
    graphs = run["graphs"]
    n = len(graphs)
    inside = graphs[0]["checkpoint_inside"] if graphs else None
    calls = sum(g["calls"] for g in graphs) / steps if graphs else 0
    breaks = len(run["graph_breaks"]) + run["frames_given_up"]
    return [
        (str(n), GOOD if n == 1 else BAD),
        (
            "-" if inside is None else ("yes" if inside else "no"),
            GOOD if inside else BAD,
        ),
        (f"{calls:g}", GOOD if calls == 2 else (NOTE if calls else BAD)),
        ("0" if not breaks else str(breaks), GOOD if not breaks else NOTE),
    ]


def orders_figure(runs: dict[str, dict], steps: int):
    """One row per order, one column per fact: graphs compiled, checkpoint inside the
    graph, graph calls per step (2 blocks), graph breaks plus frames given up."""
    import matplotlib.pyplot as plt

    heads = ["graphs", "ckpt\ninside", "graph calls\nper step", "breaks"]
    names = list(runs)
    fig, ax = plt.subplots(figsize=(7.6, 0.52 * len(names) + 1.1))
    for row, name in enumerate(names):
        cells = _cells(name, runs[name], steps)
        if cells[-1][0] in ("reference", "error"):
            text, colour = cells[-1]
            ax.add_patch(
                plt.Rectangle((0, row), len(heads), 1, color=colour, ec="white", lw=2)
            )
            what = "trained eagerly: the reference" if text == "reference" else None
            what = what or "fails at the first forward"
            ax.text(
                len(heads) / 2, row + 0.5, what, ha="center", va="center", fontsize=FONT
            )
            continue
        for col, (text, colour) in enumerate(cells):
            ax.add_patch(
                plt.Rectangle((col, row), 1, 1, color=colour, ec="white", lw=2)
            )
            ax.text(col + 0.5, row + 0.5, text, ha="center", va="center", fontsize=FONT)
    ax.set_xlim(0, len(heads))
    ax.set_ylim(len(names), 0)
    ax.set_xticks([i + 0.5 for i in range(len(heads))], heads, fontsize=FONT - 1)
    ax.xaxis.tick_top()
    ax.set_yticks(
        [i + 0.5 for i in range(len(names))],
        [ORDER_LABELS.get(n, n) for n in names],
        fontsize=FONT,
    )
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    fig.tight_layout()
    return fig


def compute_share(bench: dict) -> dict:
    """A recorded ``bench.fsdp_compile`` run against its arithmetic. FLOPs per token are
    ``flops.flops_per_token`` (6N plus attention), a third more with full activation
    checkpointing (the forward runs twice); the peak is the GPU's dense datasheet figure
    for the run's dtype (``flops.DATASHEET_PEAKS``)."""
    from distlab.data import token_data

    p = bench["provenance"]
    s = p["settings"]
    cfg = preset(s["preset"], vocab_size=token_data().vocab_size)
    tokens = s["batch_size"] * cfg.block_size
    recompute = 4 / 3 if s["ac"] == "full" else 1.0
    step_flops = flops_per_token(cfg) * tokens * recompute
    gpu = " ".join(p.get("gpu_names") or [p["machine"]])
    precision = "bf16" if s["dtype"] == "bf16" else "tf32"
    sheet = next(
        (
            (g, peaks[precision])
            for pat, g, peaks in DATASHEET_PEAKS
            if re.search(pat, gpu)
        ),
        None,
    )
    runs = []
    for r in bench["runs"]:
        achieved = step_flops / r["median_step_s"]
        runs.append(
            {
                "variant": r["variant"],
                "median_step_s": r["median_step_s"],
                "achieved_flops_per_s": achieved,
                "mfu": achieved / sheet[1] if sheet else None,
            }
        )
    return {
        "preset": s["preset"],
        "params": sum(p.numel() for p in _params(cfg)),
        "tokens_per_step": tokens,
        "step_flops": step_flops,
        "peak": sheet,
        "seconds_at_peak": step_flops / sheet[1] if sheet else None,
        "runs": runs,
        "speedup": bench["comparison"]["speedup"],
    }


def _params(cfg):
    import torch

    from distlab.model import GPT

    with torch.device("meta"):
        return list(GPT(cfg).parameters())


def step_figure(shares: list[dict]):
    """Per recorded run: the measured median steps (eager, compiled) and the time the
    step's FLOPs take at the datasheet peak, in ms."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(shares), 1, figsize=(7.0, 1.9 * len(shares) + 0.4), squeeze=False
    )
    for ax, share in zip(axes[:, 0], shares):
        labels = [r["variant"].replace(" (inductor)", "") for r in share["runs"]]
        values = [1000 * r["median_step_s"] for r in share["runs"]]
        colours = ["#4c72b0", "#55a868"]
        if share["seconds_at_peak"]:
            labels.append(f"its FLOPs at {share['peak'][0]} peak")
            values.append(1000 * share["seconds_at_peak"])
            colours.append("#c44e52")
        ax.barh(range(len(values)), values, color=colours[: len(values)])
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.1f} ms", va="center", fontsize=FONT - 1)
        ax.set_yticks(range(len(values)), labels, fontsize=FONT - 1)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.3)
        ax.set_title(
            f"{share['preset']} ({share['params'] / 1e6:.0f}M parameters), "
            f"{share['tokens_per_step']:,} tokens a step",
            fontsize=FONT,
        )
        ax.tick_params(axis="x", labelsize=FONT - 2)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1, 0].set_xlabel("ms per training step", fontsize=FONT)
    fig.tight_layout()
    return fig
