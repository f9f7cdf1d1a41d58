"""The memory calculator's figures: what each rank holds per ZeRO stage, the stages
against N, and the bytes of a step by part.

    holdings_figure(ranks=4)  # the ZeRO chapter's key figure
    stages_figure(psi=7.5e9)  # GB per rank and reduction against N
    fig, estimates = breakdown_figure("gpt2", ranks=8, micro_batch=8, seq_len=1024)

Every bar is a number from ``distlab.tools.memory_calculator``, none drawn by hand.
"""

from __future__ import annotations

from distlab.tools.memory_calculator import (
    GB,
    PARTS,
    bytes_per_param,
    estimate,
    per_rank_bytes,
)

# the paper's stage -> the calculator's strategy
STAGE_NAMES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp2"}
STAGE_LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp2": "ZeRO-3"}
COLORS = {"params": "#3b6ea5", "grads": "#7fb0dd", "optimizer": "#e39b4c"}


def reduction(strategy: str, n: int, dtype: str) -> float:
    """Model-state bytes per rank under DDP over those under ``strategy`` on ``n``
    ranks (AdamW)."""
    return (
        per_rank_bytes(1.0, 1, dtype)["total"]
        / per_rank_bytes(1.0, n, dtype, "adamw", strategy)["total"]
    )


def holdings_figure(ranks: int = 4, dtype: str = "bf16_mixed", optimizer="adamw"):
    """One panel per stage, one column per rank: the bytes per parameter of each part,
    filled where this rank holds them, outlined where another rank does."""
    import matplotlib.pyplot as plt

    whole = bytes_per_param(dtype, optimizer)
    # 6.4 in wide, fonts of 16 pt and more: readable at a phone's 360 px
    fig, grid = plt.subplots(2, 2, figsize=(6.4, 7.2), sharey=True)
    axes = grid.ravel()
    names = {"params": "params", "grads": "grads", "optimizer": "optim."}
    for ax, strategy in zip(axes, STAGE_NAMES.values()):
        held = per_rank_bytes(1.0, ranks, dtype, optimizer, strategy)
        for r in range(ranks):
            bottom = 0.0
            for part in PARTS:
                size, mine = whole[part], held[part]
                ax.bar(r, size, bottom=bottom, color="none", ec=COLORS[part], lw=1.2)
                # a sharded part: this rank's 1/N slice, at its place in the part
                at = bottom if mine == size else bottom + r * mine
                label = names[part] if (r == 0 and ax is axes[0]) else None
                ax.bar(
                    r, mine, bottom=at, color=COLORS[part], ec="k", lw=0.4, label=label
                )
                bottom += size
        ax.set_title(f"{STAGE_LABELS[strategy]}: {held['total']:g} B", fontsize=18)
        ax.set_xticks(range(ranks), [str(r) for r in range(ranks)], fontsize=16)
        ax.set_yticks([0, 4, 8, 12, 16])
        ax.tick_params(axis="y", labelsize=16)
        ax.spines[["top", "right"]].set_visible(False)
    fig.supxlabel("rank", fontsize=16, y=0.085)
    fig.supylabel("bytes per parameter", fontsize=16)
    fig.legend(
        loc="lower center",
        ncol=3,
        fontsize=16,
        frameon=False,
        handlelength=1.2,
        columnspacing=1.0,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def partition_figure(sizes: list[int], owners: list[int], ranks: int):
    """ZeRO-1's partition of real tensors: one bar per rank, one segment per tensor it
    owns (as wide as its elements), against the even split, Ψ/N."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 1.6 + 0.9 * ranks))
    for r in range(ranks):
        left = 0
        mine = sorted((s for s, o in zip(sizes, owners) if o == r), reverse=True)
        for i, size in enumerate(mine):
            shade = COLORS["optimizer"] if i % 2 == 0 else "#f3c89b"
            ax.barh(r, size, left=left, color=shade, ec="k", lw=0.4)
            left += size
        ax.text(left, r, f" {len(mine)} tensors", va="center", fontsize=16)
    even = sum(sizes) / ranks
    ax.axvline(even, color="k", ls="--", lw=1)
    ax.text(even, -0.55, "Ψ/N", fontsize=16, ha="center", va="bottom")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=16)
    ax.set_ylim(ranks - 0.5, -1.05)  # rank 0 on top, room for the label
    ax.set_xlabel("elements it keeps state for", fontsize=16)
    ax.set_xlim(0, 1.6 * max(even, ax.get_xlim()[1]))
    ax.tick_params(axis="x", labelsize=14)
    ax.xaxis.set_major_locator(plt.MaxNLocator(3))
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


# the three moments of one ZeRO-1 step, and what each shows of the trace
ZERO1_PHASES = (
    ("backward", "grad", "DDP has averaged every gradient on every rank"),
    ("own step", "local", "each rank has updated the tensors it owns, only those"),
    ("broadcast", "broadcast", "every rank holds the whole new model"),
)


def zero1_step_views(traces: list[dict]) -> list[tuple[str, object]]:
    """One view per moment of a ZeRO-1 step, from what each rank recorded
    (``_trace_first_step``): per rank, a cell per tensor (in model order) for the
    parameters (new or stale), the gradients and the optimizer state."""
    import matplotlib.pyplot as plt

    views = []
    n_tensors = len(traces[0]["grad"])
    for title, key, caption in ZERO1_PHASES:
        fig, ax = plt.subplots(figsize=(6.4, 1.4 + 1.7 * len(traces)))
        rows = []
        for r, trace in enumerate(traces):
            new = trace["local"] if key == "local" else trace["broadcast"]
            if key == "grad":
                new = [False] * n_tensors
            strips = (
                ("params", new, COLORS["params"]),  # grey: the old values
                ("grads", trace["grad"], COLORS["grads"]),
                ("AdamW", trace["state"], COLORS["optimizer"]),
            )
            for name, filled, color in strips:
                y = len(rows)
                rows.append(f"{r}: {name}")
                for i, on in enumerate(filled):
                    face = color if on else ("#dddddd" if name == "params" else "none")
                    ax.barh(y, 1, left=i, color=face, ec="k", lw=0.3)
        ax.set_yticks(range(len(rows)), rows, fontsize=16)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(0, n_tensors)
        ax.set_xticks([])
        ax.set_xlabel(f"the {n_tensors} tensors, in order", fontsize=16)
        ax.set_title(f"after {title}", fontsize=17)
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
        fig.tight_layout()
        views.append((f"<p><b>After {title}</b>: {caption}.</p>", fig))
    return views


def stages_figure(psi: float = 7.5e9, ns: list[int] | None = None):
    """Left: GB per rank against N for each stage. Right: each stage's reduction against
    DDP, in bf16 mixed precision (K = 12) and fp32."""
    import matplotlib.pyplot as plt

    ns = ns or [2**i for i in range(11)]
    colors = ["#888", "#3b6ea5", "#6c9bd2", "#e39b4c"]
    names = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    fig, (ax_bytes, ax_red) = plt.subplots(2, 1, figsize=(6.4, 11))
    for stage, strategy in STAGE_NAMES.items():
        gb = [
            per_rank_bytes(psi, n, "bf16_mixed", "adamw", strategy)["total"] / GB
            for n in ns
        ]
        ax_bytes.plot(ns, gb, marker="o", ms=3, color=colors[stage], label=names[stage])
    ax_bytes.set(
        yscale="log",
        ylabel="GB per rank",
        title=f"{psi / 1e9:g}B parameters, bf16 mixed",
    )
    ax_bytes.axhline(32, color="k", lw=0.6, ls=":")
    ax_bytes.text(2**5, 40, "32 GB (V100)", fontsize=15)
    ax_bytes.legend(fontsize=15, loc="lower left")
    for stage in (1, 2, 3):
        for dtype, style, marker in (("bf16_mixed", "-", None), ("fp32", "--", "x")):
            if stage == 3 and dtype == "fp32":
                continue  # the same line, N, for any precision
            label = names[stage] + (
                "" if stage == 3 else ", K=12" if dtype == "bf16_mixed" else ", fp32"
            )
            values = [reduction(STAGE_NAMES[stage], n, dtype) for n in ns]
            ax_red.plot(
                ns, values, style, marker=marker, ms=4, color=colors[stage], label=label
            )
    for limit in (2, 4, 8):
        ax_red.axhline(limit, color="k", lw=0.5, ls=":")
        ax_red.text(1.05, limit + 0.2, f"{limit}x", fontsize=15)
    ax_red.set(ylim=(0, 13), ylabel="reduction vs DDP", title="reduction per rank")
    ax_red.legend(
        fontsize=15,
        loc="upper center",
        ncol=2,
        handlelength=1.5,
        columnspacing=0.8,
        bbox_to_anchor=(0.45, -0.2),
        frameon=False,
    )
    for ax in (ax_bytes, ax_red):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks N", fontsize=16)
        ax.yaxis.label.set_size(16)
        ax.title.set_size(17)
        ax.tick_params(labelsize=15)
    fig.tight_layout()
    return fig


def breakdown_figure(
    model: str, ranks: int, micro_batch: int, seq_len: int, dtype: str = "bf16_mixed"
):
    """Bytes per rank by part under each ZeRO stage, and ZeRO-3 with activation
    checkpointing, as the calculator estimates them; the estimates come back with
    the figure."""
    import matplotlib.pyplot as plt

    colors = {
        "params": "#3b6ea5",
        "grads": "#6c9bd2",
        "optimizer": "#a9c6ea",
        "gathered": "#7a9e5a",
    }
    colors["activations"] = "#e39b4c"
    cases = [(s, False) for s in STAGE_NAMES.values()] + [("fsdp2", True)]
    estimates = {}
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    for row, (strategy, ac) in enumerate(cases):
        est = estimate(
            model,
            ranks,
            dtype,
            "adamw",
            strategy,
            micro_batch=micro_batch,
            seq_len=seq_len,
            activation_checkpointing=ac,
        )
        estimates[strategy + (" + AC" if ac else "")] = est
        left = 0.0
        for part, color in colors.items():
            ax.barh(
                row,
                (est[part] or 0) / GB,
                left=left / GB,
                color=color,
                label=part if row == 0 else None,
            )
            left += est[part] or 0
    ax.set_yticks(range(len(cases)), list(estimates), fontsize=16)
    ax.invert_yaxis()
    ax.set_xlabel("GB per rank", fontsize=16)
    ax.tick_params(axis="x", labelsize=15)
    ax.legend(
        ncol=2,
        fontsize=15,
        loc="upper center",
        bbox_to_anchor=(0.4, -0.2),
        frameon=False,
    )
    fig.tight_layout()
    return fig, estimates
