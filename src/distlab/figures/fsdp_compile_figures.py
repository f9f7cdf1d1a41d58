"""Figures and readings for book/fsdp_compile.md.

* ``orders_figure``: what Dynamo did in each order of checkpoint, compile and shard,
  drawn as a table from the page's own run (``chapters.fsdp_compile.tour``);
* ``compute_share``: a recorded GPU run (``bench.fsdp_compile``) read against its
  arithmetic: FLOPs per step, achieved FLOP/s, MFU of the datasheet peak, and how long
  the step's FLOPs would take at that peak;
* ``step_figure``: the measured steps beside that time at peak.
"""

from __future__ import annotations

from distlab.flops import datasheet_entry, flops_per_token
from distlab.model import preset

LABEL = 16  # a 5.2-inch figure shown 360 px wide: 16 pt is about 11 px
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
    """One band per order: its name on a line of its own, then one cell per fact:
    graphs compiled, checkpoint inside the graph, graph calls per step (2 blocks),
    graph breaks plus frames given up. Narrow and tall, so that a phone shows it at a
    readable size."""
    import matplotlib.pyplot as plt

    heads = ["graphs", "ckpt\ninside", "calls\na step", "breaks"]
    names = list(runs)
    label_h, cell_h = 0.62, 0.9  # in cell widths
    band = label_h + cell_h
    fig, ax = plt.subplots(figsize=(5.2, 0.78 * band * len(names) + 0.9))
    for k, name in enumerate(names):
        top = k * band
        ax.text(
            0.02,
            top + label_h * 0.55,
            ORDER_LABELS.get(name, name),
            ha="left",
            va="center",
            fontsize=LABEL,
            weight="bold",
        )
        row = top + label_h
        cells = _cells(name, runs[name], steps)
        if cells[-1][0] in ("reference", "error"):
            text, colour = cells[-1]
            ax.add_patch(
                plt.Rectangle(
                    (0, row), len(heads), cell_h, color=colour, ec="white", lw=3
                )
            )
            what = "trains eagerly: the reference" if text == "reference" else None
            what = what or "fails at the first forward"
            ax.text(
                len(heads) / 2,
                row + cell_h / 2,
                what,
                ha="center",
                va="center",
                fontsize=LABEL,
            )
            continue
        for col, (text, colour) in enumerate(cells):
            ax.add_patch(
                plt.Rectangle((col, row), 1, cell_h, color=colour, ec="white", lw=3)
            )
            ax.text(
                col + 0.5,
                row + cell_h / 2,
                text,
                ha="center",
                va="center",
                fontsize=LABEL,
            )
    ax.set_xlim(0, len(heads))
    ax.set_ylim(band * len(names), 0)
    ax.set_xticks([i + 0.5 for i in range(len(heads))], heads, fontsize=LABEL)
    ax.xaxis.tick_top()
    ax.set_yticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    fig.tight_layout()
    return fig


def compute_share(bench: dict) -> dict:
    """A recorded ``bench.fsdp_compile`` run against its arithmetic.

    ``model_flops``: what the model needs per step, ``flops.flops_per_token`` (6N plus
    attention) times the tokens; MFU divides it by time and peak, recompute not counted
    (PaLM's definition, as in ``distlab.flops``). ``step_flops``: what the GPU executes,
    a third more with full activation checkpointing (the blocks' forward runs twice; the
    head's share is negligible at a 65-token vocabulary); HFU divides that. The peak is
    the GPU's dense datasheet figure for the run's dtype (``flops.DATASHEET_PEAKS``)."""
    from distlab.data import token_data

    p = bench["provenance"]
    s = p["settings"]
    cfg = preset(s["preset"], vocab_size=token_data().vocab_size)
    tokens = s["batch_size"] * cfg.block_size
    model_flops = flops_per_token(cfg) * tokens
    step_flops = model_flops * (4 / 3 if s["ac"] == "full" else 1.0)
    gpu = " ".join(p.get("gpu_names") or [p["machine"]])
    precision = "bf16" if s["dtype"] == "bf16" else "tf32"
    entry = datasheet_entry(gpu)
    sheet = (entry[0], entry[1][precision]) if entry else None
    runs = []
    for r in bench["runs"]:
        achieved = step_flops / r["median_step_s"]
        runs.append(
            {
                "variant": r["variant"],
                "median_step_s": r["median_step_s"],
                "achieved_flops_per_s": achieved,
                "mfu": model_flops / r["median_step_s"] / sheet[1] if sheet else None,
                "hfu": achieved / sheet[1] if sheet else None,
            }
        )
    return {
        "preset": s["preset"],
        "ac": s["ac"],
        "card": sheet[0] if sheet else gpu.replace("NVIDIA ", ""),
        "torch": p.get("torch", "?").split("+")[0],
        "params": sum(p.numel() for p in _params(cfg)),
        "tokens_per_step": tokens,
        "model_flops": model_flops,
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
    """Per recorded run, one panel titled with its card: the measured median steps
    (eager, compiled) and the time the step's executed FLOPs take at the datasheet peak,
    in ms. Each panel has its own scale: the cards differ, so the panels do not compare
    with each other."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(shares), 1, figsize=(5.2, 2.6 * len(shares) + 0.5), squeeze=False
    )
    for ax, share in zip(axes[:, 0], shares):
        labels = [r["variant"].replace(" (inductor)", "") for r in share["runs"]]
        values = [1000 * r["median_step_s"] for r in share["runs"]]
        colours = ["#4c72b0", "#55a868"]
        if share["seconds_at_peak"]:
            labels.append("at peak")
            values.append(1000 * share["seconds_at_peak"])
            colours.append("#c44e52")
        ax.barh(range(len(values)), values, color=colours[: len(values)])
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.1f}", va="center", fontsize=LABEL)
        ax.set_yticks(range(len(values)), labels, fontsize=LABEL)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.35)
        ax.set_xticks([])
        ax.set_title(f"{share['card']}, {share['preset']}", fontsize=LABEL, loc="left")
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
    axes[-1, 0].set_xlabel("ms per training step", fontsize=LABEL)
    fig.tight_layout()
    return fig


def busy_records(results_dir) -> dict[str, list[dict]]:
    """The recorded ``bench.gpu_busy`` runs (``results/gpu_busy_*.json``) by preset:
    for each, the card, the steps profiled, the eager step's GPU-busy share, and the
    eager and compiled step times of its unprofiled window (one mean of ``steps``)."""
    import json

    out: dict[str, list[dict]] = {}
    for path in sorted(results_dir.glob("gpu_busy_*.json")):
        rec = json.loads(path.read_text())
        prov = rec["provenance"]
        eager, compiled = rec["runs"]
        out.setdefault(prov["settings"]["preset"], []).append(
            {
                "card": prov["gpu_names"][0].replace("NVIDIA ", ""),
                "torch": prov["torch"].split("+")[0],
                "ac": prov["settings"]["ac"],
                "steps": prov["settings"]["steps"],
                "busy": eager["gpu_busy_share"],
                "speedup": eager["step_s"] / compiled["step_s"],
            }
        )
    return out
