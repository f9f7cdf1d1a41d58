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
    happened on rank 0, a box each, the block's number in it; a line where the
    backward pass begins."""
    import matplotlib.pyplot as plt

    width = max(len(seq) for _, seq in rows)
    fig, ax = plt.subplots(figsize=(7, 0.95 * len(rows) + 1.3))
    for lane, (title, seq) in enumerate(rows):
        y = len(rows) - 1 - lane
        ax.text(-0.5, y + 0.42, title, fontsize=11, va="bottom")
        for x, (kind, block, _) in enumerate(seq):
            colour, prefix = SEQUENCE_STYLE[kind]
            ax.add_patch(plt.Rectangle((x - 0.45, y - 0.3), 0.9, 0.6, color=colour))
            ax.text(x, y, f"{prefix}{block}", ha="center", va="center",
                    fontsize=10, color="white", weight="bold")  # fmt: skip
        first_bw = next(
            x for x, (k, _, where) in enumerate(seq)
            if k in ("recompute", "reduce-scatter", "pre-forward hook")
            or where.endswith("in backward")
        )  # fmt: skip
        ax.plot([first_bw - 0.5] * 2, [y - 0.4, y + 0.4], color="black", lw=1.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in SEQUENCE_STYLE.values()]
    labels = [f"{p}: {k}" for k, (_, p) in SEQUENCE_STYLE.items()]
    ax.legend(handles, labels, ncol=3, fontsize=9, loc="upper center",
              bbox_to_anchor=(0.5, 0.0), frameon=False)  # fmt: skip
    ax.set_xlim(-0.6, width - 0.4)
    ax.set_ylim(-0.6, len(rows) - 0.1)
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
    runs): bytes kept after forward against the median step time, both relative to
    no checkpointing; the bar spans the fastest to the slowest timed step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7, 3.6), sharey=True)
    for ax, (title, runs) in zip(axes, panels):
        none = runs[0]["median_step_s"]
        for r in runs:
            x, y = r["time_vs_none"], r["saved_vs_none"]
            low, high = min(r["step_s"]) / none, max(r["step_s"]) / none
            hot = r["policy"] in ("selective", "full, every 3rd block")
            ax.errorbar(x, y, xerr=[[x - low], [high - x]], fmt="o", capsize=3,
                        color="tab:red" if hot else "tab:blue")  # fmt: skip
            left = r["policy"] == "selective"  # same bytes as every 3rd: apart
            ax.annotate(SHORT[r["policy"]], (x, y), textcoords="offset points",
                        xytext=(0, -16) if left else (4, 5), fontsize=10,
                        ha="center" if left else "left")  # fmt: skip
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step time / none", fontsize=11)
        ax.axvline(1.0, color="0.8", lw=1, zorder=0)
        ax.tick_params(labelsize=10)
    axes[0].set_ylabel("kept after forward / none", fontsize=11)
    axes[0].set_ylim(0, 1.1)
    fig.tight_layout()
    return fig
