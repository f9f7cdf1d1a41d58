"""The key figures of the FSDP2 lab pages (labs/lab4_fsdp2.md,
labs/lab5_activation_ckpt.md), drawn from what their real runs wrote: the bytes one
rank holds (``state_bytes_per_rank`` in each lab's ``summary.json``), the bytes a
micro-batch keeps for backward, and the logged losses. Stacked panels, so that a phone
shows both at a readable size."""

from __future__ import annotations

PARTS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c"}


def _curves(ax, curves: dict[str, list[float]], ylabel: str) -> None:
    """The first curve wide and pale, the others thin on top of it."""
    for k, (label, values) in enumerate(curves.items()):
        style = {"lw": 5, "alpha": 0.35} if k == 0 else {"lw": 1.5}
        ax.plot(values, label=label, **style)
    ax.set_xlabel("step", fontsize=12)
    ax.set_ylabel(ylabel, fontsize=12)
    ax.legend(fontsize=11, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)


def state_and_losses_figure(
    state: dict[str, dict[str, int]], losses: dict[str, list[float]]
):
    """Top: the model state one rank holds under each lab (``{lab: {"params": bytes,
    "grads": ..., "optimizer": ...}}``), stacked bars in kB. Below: the training
    losses, ``{label: loss at each step}``."""
    import matplotlib.pyplot as plt

    fig, (ax, ax_loss) = plt.subplots(
        2, 1, figsize=(6.4, 5.6), gridspec_kw={"height_ratios": [1, 1.5]}
    )
    labels = list(state)
    for y, lab in enumerate(labels):
        left = 0.0
        for part, color in PARTS.items():
            size = state[lab][part] / 1e3
            ax.barh(y, size, left=left, color=color, label=part if y == 0 else None)
            left += size
    ax.set_yticks(range(len(labels)), labels, fontsize=12)
    ax.invert_yaxis()
    ax.set_xlabel("kB of model state on rank 0", fontsize=12)
    ax.legend(
        ncol=3, fontsize=11, frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1)
    )
    ax.spines[["top", "right"]].set_visible(False)
    _curves(ax_loss, losses, "training loss")
    fig.tight_layout()
    return fig


def kept_and_norms_figure(kept: dict[str, int], norms: dict[str, list[float]]):
    """Top: the bytes one micro-batch keeps for backward under each ``--ac`` mode
    (``{mode: bytes}``), in MB. Below: the gradient norm each lab logged per step."""
    import matplotlib.pyplot as plt

    fig, (ax, ax_norm) = plt.subplots(
        2, 1, figsize=(6.4, 5.2), gridspec_kw={"height_ratios": [1, 1.5]}
    )
    modes = list(kept)
    ax.barh(range(len(modes)), [kept[m] / 1e6 for m in modes], color="#9467bd")
    ax.set_yticks(range(len(modes)), [f"--ac {m}" for m in modes], fontsize=12)
    ax.invert_yaxis()
    ax.set_xlabel("MB kept for backward (one micro-batch)", fontsize=12)
    ax.spines[["top", "right"]].set_visible(False)
    _curves(ax_norm, norms, "gradient norm")
    fig.tight_layout()
    return fig
