"""Figures for book/ac_policies.md.

* ``tradeoff_figure``: the recorded GPU benchmark (``bench.ac_policies``): memory kept
  after forward against step time, one point per policy;
* ``policy_figure``: per policy, on the tiny model, the bytes kept and which operators
  backward reruns, from ``chapters.ac_policies.policy_costs`` and ``budget_sweep``;
* ``recompute_counts``: the operators worth reading among those rerun, per block.
"""

from __future__ import annotations

FONT = 13  # read on a phone (~360 px wide): few labels, large letters
EAGER, COMPILED, OFFLOAD = "#4c72b0", "#55a868", "#c44e52"
KINDS = ("matmul", "attention", "LayerNorm", "GELU")

# short names for the recorded configurations, and where each label goes (points)
SHORT = {
    "none": ("none", (6, 6)),
    "full": ("full", (8, 4)),
    "save all matmuls": ("save all matmuls", (-10, 10)),
    "every other matmul": ("every other matmul", (-30, 12)),
    "save_on_cpu(pin_memory=True)": ("save_on_cpu", (12, -22)),
    "HostOffload": ("HostOffload", (12, -40)),
    "compiled, budget 1.0": ("budget 1.0", (-34, -18)),
    "compiled, budget 0.5": ("budget 0.5", (-20, -20)),
    "compiled, budget 0.0": ("budget 0.0", (8, -14)),
}


def _colour(config: str) -> str:
    if config.startswith("compiled"):
        return COMPILED
    if "cpu" in config.lower() or "offload" in config.lower():
        return OFFLOAD
    return EAGER


def tradeoff_figure(bench: dict, cap: float = 1.4):
    """Memory kept on the GPU after forward (GB) against the median step time (x none),
    one point per configuration; points above ``cap`` sit on the top edge, labelled with
    their ratio."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 4.4))
    for r in bench["runs"]:
        name, offset = SHORT.get(r["config"], (r["config"], (6, 6)))
        x, y = r["kept_after_forward"] / 1e9, r["time_vs_none"]
        colour = _colour(r["config"])
        if y > cap:
            name = f"{name} {y:.1f}x"
            y = cap
            ax.plot([x], [y], "^", color=colour, ms=11, clip_on=False)
        else:
            ax.plot([x], [y], "o", color=colour, ms=10)
        ax.annotate(
            name,
            (x, y),
            xytext=offset,
            textcoords="offset points",
            fontsize=FONT - 1,
            color=colour,
            annotation_clip=False,
        )
    ax.set_ylim(0.9, cap)
    ax.set_xlim(-0.2, 5.6)
    ax.set_xlabel("GB kept on the GPU after forward", fontsize=FONT)
    ax.set_ylabel("step time (x none)", fontsize=FONT)
    ax.tick_params(labelsize=FONT - 1)
    ax.grid(alpha=0.3)
    for label, colour in (
        ("eager", EAGER),
        ("compiled", COMPILED),
        ("offload", OFFLOAD),
    ):
        ax.plot([], [], "o", color=colour, label=label)
    ax.legend(fontsize=FONT - 1, loc="upper right")
    fig.tight_layout()
    return fig


def recompute_counts(ops: dict[str, int], blocks: int = 1) -> dict[str, float]:
    """Operators rerun in backward, per block, by kind: ``addmm``/``mm`` as matmul,
    forward attention kernels, LayerNorm and GELU (their backward kernels left out)."""
    counts = dict.fromkeys(KINDS, 0)
    for op, n in ops.items():
        if op in ("addmm", "mm", "bmm"):
            counts["matmul"] += n
        elif "backward" in op:
            continue
        elif "attention" in op:
            counts["attention"] += n
        elif "layer_norm" in op:
            counts["LayerNorm"] += n
        elif "gelu" in op:
            counts["GELU"] += n
    return {kind: n / blocks for kind, n in counts.items()}


HEADS = {"matmul": "mm", "attention": "attn", "LayerNorm": "LN", "GELU": "GELU"}


def policy_figure(costs: dict[str, dict], budgets: list[dict], n_layer: int):
    """Left: bytes kept for backward, as a fraction of no checkpointing (eager: the
    whole model after forward; compiled, green: one block's saved tensors). Right:
    operators rerun in backward per block, by kind."""
    import matplotlib.pyplot as plt

    rows = []
    none = costs["none"]["kept"]
    for name, r in costs.items():
        label = "MUST_CPU_OFFLOAD" if name.startswith("offload") else name
        rows.append(
            (label, r["kept"] / none, recompute_counts(r["recomputed_ops"], n_layer))
        )
    eager_block = budgets[0]["saved"]
    for r in budgets[1:]:
        rows.append(
            (
                f"budget {r['budget']}",
                r["saved"] / eager_block,
                recompute_counts(r["recomputed_ops"]),
            )
        )
    fig, (bars, grid) = plt.subplots(
        1,
        2,
        figsize=(5.2, 0.5 * len(rows) + 1.3),
        gridspec_kw={"width_ratios": [1, 1.5]},
        sharey=True,
    )
    for i, (label, kept, counts) in enumerate(rows):
        colour = COMPILED if label.startswith("budget") else EAGER
        bars.barh(i, kept, color=colour)
        bars.text(kept + 0.04, i, f"{kept:.2f}", va="center", fontsize=FONT - 1)
        for j, kind in enumerate(KINDS):
            n = counts[kind]
            grid.add_patch(
                plt.Rectangle(
                    (j, i - 0.5), 1, 1, color="#f6b26b" if n else "#eeeeee", ec="white"
                )
            )
            grid.text(j + 0.5, i, f"{n:g}", ha="center", va="center", fontsize=FONT)
    bars.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=FONT)
    bars.invert_yaxis()
    bars.set_xlim(0, 1.6)
    bars.set_xticks([0, 1])
    bars.set_title("kept", fontsize=FONT)
    bars.tick_params(axis="x", labelsize=FONT - 1)
    grid.set_xlim(0, len(KINDS))
    grid.set_xticks(
        [j + 0.5 for j in range(len(KINDS))], [HEADS[k] for k in KINDS], fontsize=FONT
    )
    grid.xaxis.tick_top()
    grid.set_title("rerun per block", fontsize=FONT, pad=26)
    grid.tick_params(length=0)
    for ax in (bars, grid):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        grid.spines[side].set_visible(False)
    fig.tight_layout(w_pad=0.3)
    return fig
