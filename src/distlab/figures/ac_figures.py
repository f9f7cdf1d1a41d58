"""Figures of the activation checkpointing chapter drawn from recorded runs: where
FSDP2's hooks fire under each wrapping order (``orders_figure``), and the bytes kept
against the step time of each policy (``tradeoff_figure``)."""

from __future__ import annotations

SEQUENCE_STYLE = {  # kind: (colour, label prefix)
    "all-gather": ("tab:purple", "AG"),
    "forward": ("tab:blue", "F"),
    "pre-forward hook": ("tab:red", "pf"),
    "recompute": ("tab:orange", "R"),
    "reduce-scatter": ("0.55", "RS"),
}


def orders_figure(rows: list[tuple[str, list[tuple[str, int, str]]]]):
    """One lane per wrapping: the events of ``hook_sequence`` in the order they
    happened on rank 0, a box each, the block's number in it; the forward pass on a
    row of its own above the backward pass (narrow, for a phone)."""
    import matplotlib.pyplot as plt

    def split(seq):
        first_bw = next(
            x for x, (k, _, where) in enumerate(seq)
            if k in ("recompute", "reduce-scatter", "pre-forward hook")
            or where.endswith("in backward")
        )  # fmt: skip
        return seq[:first_bw], seq[first_bw:]

    parts = [split(seq) for _, seq in rows]
    width = max(len(p) for pair in parts for p in pair)
    lane_h = 3.2  # title, forward row, backward row
    fig, ax = plt.subplots(figsize=(5.2, 1.55 * len(rows) + 1.4))
    for lane, ((title, _), pair) in enumerate(zip(rows, parts)):
        top = (len(rows) - lane) * lane_h
        ax.text(-1.3, top - 0.35, title, fontsize=13, va="center")
        for r, (name, seq) in enumerate(zip(("fwd", "bwd"), pair)):
            y = top - 1.25 - 1.05 * r
            ax.text(-0.65, y, name, fontsize=12, ha="right", va="center")
            for x, (kind, block, _) in enumerate(seq):
                colour, prefix = SEQUENCE_STYLE[kind]
                ax.add_patch(plt.Rectangle((x - 0.46, y - 0.42), 0.92, 0.84,
                                           color=colour))  # fmt: skip
                ax.text(x, y, f"{prefix}{block}", ha="center", va="center",
                        fontsize=11, color="white", weight="bold")  # fmt: skip
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in SEQUENCE_STYLE.values()]
    labels = [f"{p}: {k}" for k, (_, p) in SEQUENCE_STYLE.items()]
    ax.legend(handles, labels, ncol=2, fontsize=12, loc="upper center",
              bbox_to_anchor=(0.5, -0.02), frameon=False, handlelength=1,
              columnspacing=1.0)  # fmt: skip
    ax.set_xlim(-1.4, width - 0.4)
    ax.set_ylim(lane_h - 2.9, len(rows) * lane_h + 0.1)
    ax.axis("off")
    fig.tight_layout()
    return fig


SHORT = {  # the benchmark's policy labels, as the figure writes them
    "none": "none",
    "full, every 3rd block": "every 3rd",
    "full, every 2nd block": "every 2nd",
    "full": "full",
    "selective": "selective",
}


def tradeoff_figure(panels: list[tuple[str, list[dict]]]):
    """One panel per recorded benchmark (``distlab.bench.ac``'s ``single_process``
    runs), stacked, each on its own time axis (different machines and models: not to
    be read against each other): bytes kept after forward against the median step
    time, both relative to no checkpointing; the bar spans the fastest to the slowest
    timed step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(4.8, 3.3 * len(panels)))
    for ax, (title, runs) in zip(axes, panels):
        none = runs[0]["median_step_s"]
        for r in runs:
            x, y = r["time_vs_none"], r["saved_vs_none"]
            low, high = min(r["step_s"]) / none, max(r["step_s"]) / none
            hot = r["policy"] in ("selective", "full, every 3rd block")
            ax.errorbar(x, y, xerr=[[x - low], [high - x]], fmt="o", capsize=4,
                        ms=8, color="tab:red" if hot else "tab:blue")  # fmt: skip
            below = r["policy"] == "selective"  # same bytes as every 3rd: apart
            ax.annotate(SHORT[r["policy"]], (x, y), textcoords="offset points",
                        xytext=(0, -22) if below else (6, 6), fontsize=13,
                        ha="center" if below else "left")  # fmt: skip
        ax.set_title(title, fontsize=13)
        ax.set_xlabel("step time / none", fontsize=13)
        ax.set_ylabel("kept / none", fontsize=13)
        ax.set_ylim(0, 1.2)
        right = max(max(r["step_s"]) / none for r in runs)
        ax.set_xlim(None, right + 0.12 * (right - ax.get_xlim()[0]))
        ax.axvline(1.0, color="0.8", lw=1, zorder=0)
        ax.tick_params(labelsize=12)
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout(h_pad=1.5)
    return fig
