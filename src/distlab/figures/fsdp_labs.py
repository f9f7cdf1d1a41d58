"""The key figures of the FSDP2 lab pages (labs/lab4_fsdp2.md,
labs/lab5_activation_ckpt.md), drawn from what their real runs wrote: the bytes one
rank holds (``state_bytes_per_rank`` in each lab's ``summary.json``), the bytes a
micro-batch keeps for backward, and the logged losses. Stacked panels, so that a phone
shows both at a readable size."""

from __future__ import annotations

PARTS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c"}


def _curves(
    ax,
    curves: dict[str, list[float]],
    ylabel: str,
    legend_above: bool = False,
    font: int = 12,
) -> None:
    """The first curve wide and pale, the others thin on top of it; the legend above
    the axes (``legend_above``) where it would cover the curves."""
    for k, (label, values) in enumerate(curves.items()):
        style = {"lw": 5, "alpha": 0.35} if k == 0 else {"lw": 1.5}
        ax.plot(values, label=label, **style)
    ax.set_xlabel("step", fontsize=font)
    ax.set_ylabel(ylabel, fontsize=font)
    ax.tick_params(labelsize=font - 1)
    where = {"loc": "lower left", "bbox_to_anchor": (0, 1)} if legend_above else {}
    ax.legend(fontsize=font - 1, frameon=False, **where)
    ax.spines[["top", "right"]].set_visible(False)


def state_and_losses_figure(
    state: dict[str, dict[str, int]],
    losses: dict[str, list[float]],
    mark_step: int | None = None,
    mark_label: str = "",
):
    """Top: the model state one rank holds under each lab (``{lab: {"params": bytes,
    "grads": ..., "optimizer": ...}}``), stacked bars in kB. Below: the training
    losses, ``{label: loss at each step}``, with a dotted line at ``mark_step``."""
    import matplotlib.pyplot as plt

    big = 16  # 5.2 inches shown 360 px wide on a phone: about 14 px
    fig, (ax, ax_loss) = plt.subplots(
        2, 1, figsize=(5.2, 7.4), gridspec_kw={"height_ratios": [1, 2.2]}
    )
    labels = list(state)
    for y, lab in enumerate(labels):
        left = 0.0
        for part, color in PARTS.items():
            size = state[lab][part] / 1e3
            ax.barh(y, size, left=left, color=color, label=part if y == 0 else None)
            left += size
    ax.set_yticks(range(len(labels)), labels, fontsize=big)
    ax.tick_params(axis="x", labelsize=big - 1)
    ax.invert_yaxis()
    ax.set_xlabel("kB of model state on rank 0", fontsize=big)
    ax.legend(
        ncol=3,
        fontsize=big - 1,
        frameon=False,
        loc="lower center",
        bbox_to_anchor=(0.5, 1),
    )
    ax.spines[["top", "right"]].set_visible(False)
    _curves(ax_loss, losses, "training loss", legend_above=True, font=big)
    if mark_step is not None:  # e.g. where the warm-up ends: the same for every run
        ax_loss.axvline(mark_step, color="0.5", ls=":", lw=1.5)
        ax_loss.annotate(
            mark_label,
            (mark_step, 1),
            xycoords=("data", "axes fraction"),
            xytext=(5, -5),
            textcoords="offset points",
            va="top",
            fontsize=big - 1,
            color="0.35",
        )
    fig.tight_layout()
    return fig


def kept_and_norms_figure(kept: dict[str, int], norms: dict[str, list[float]]):
    """Top: the bytes one micro-batch keeps for backward under each ``--ac`` mode
    (``{mode: bytes}``), in MB. Below: the gradient norm each lab logged per step, on
    a log scale (a spike would flatten the rest), its largest step marked."""
    import matplotlib.pyplot as plt

    fig, (ax, ax_norm) = plt.subplots(
        2, 1, figsize=(4.8, 5.8), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    modes = list(kept)
    ax.barh(range(len(modes)), [kept[m] / 1e6 for m in modes], color="#9467bd")
    ax.set_yticks(range(len(modes)), modes, fontsize=13)
    ax.set_ylabel("--ac", fontsize=13)
    ax.invert_yaxis()
    ax.set_xlabel("MB kept for backward", fontsize=13)
    ax.tick_params(axis="x", labelsize=12)
    ax.spines[["top", "right"]].set_visible(False)
    _curves(ax_norm, norms, "gradient norm", font=13)
    ax_norm.set_yscale("log")
    first = next(iter(norms.values()))
    top = max(range(len(first)), key=first.__getitem__)
    ax_norm.annotate(
        f"step {top}: a loss\nspike, in both",
        (top, first[top]),
        xytext=(top - 1.5, first[top]),
        ha="right",
        va="top",
        fontsize=12,
        arrowprops={"arrowstyle": "->", "color": "0.3"},
    )
    ax_norm.legend(fontsize=12, frameon=False, ncol=2, loc="lower left",
                   bbox_to_anchor=(0, 1))  # fmt: skip
    fig.tight_layout()
    return fig
