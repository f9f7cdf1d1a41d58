"""What the DDP lab pages (labs/lab2_ddp.md, labs/lab3_grad_accum.md) show: their key
figures, drawn from what a real run returned (the rows each rank took and the losses
both labs logged; the bucket all-reduces a DDP communication hook counted in each
micro-batch's backward)."""

from __future__ import annotations

from distlab.scratch.sampler import RANK_COLORS

REDUCE = "#c0392b"  # an all-reduce of the gradients
COMPUTE = "#d9d9d9"  # a micro-batch's forward and backward


def rows_and_losses_figure(
    rows: dict[int, list[int]], steps: list[int], losses: dict[str, list[float]]
):
    """Top: the rank that takes each row of one step's global batch, for each world
    size (``rows[N]`` lists the rank of row 0, 1, ...). Below: the training losses,
    ``{label: loss at each step}``: the first (one process) wide, the second thin on
    top of it. Stacked, so that a phone shows both at a readable size."""
    import matplotlib.pyplot as plt

    fig, (ax, ax_loss) = plt.subplots(
        2, 1, figsize=(6.4, 5.2), gridspec_kw={"height_ratios": [1, 1.6]}
    )
    width = max(len(r) for r in rows.values())
    for band, (world_size, ranks) in enumerate(sorted(rows.items())):
        y = -1.2 * band
        label = "1 process" if world_size == 1 else f"{world_size} ranks"
        ax.text(-0.3, y + 0.45, label, ha="right", va="center", fontsize=14)
        for row, rank in enumerate(ranks):
            ax.add_patch(plt.Rectangle((row, y), 0.9, 0.9, fc=RANK_COLORS[rank]))
            ax.text(
                row + 0.45,
                y + 0.45,
                str(rank),
                ha="center",
                va="center",
                fontsize=14,
                color="white",
                weight="bold",
            )
    ax.set_xlim(-3.2, width)
    ax.set_ylim(-1.2 * (len(rows) - 1) - 0.1, 1.0)
    ax.axis("off")
    ax.set_title(f"which rank takes each of {width} rows", fontsize=14)
    (wide, single), (thin, ddp) = losses.items()
    ax_loss.plot(steps, single, lw=7, alpha=0.35, color=RANK_COLORS[0], label=wide)
    ax_loss.plot(steps, ddp, lw=1.5, color="black", label=thin)
    ax_loss.legend(fontsize=13, frameon=False)
    ax_loss.set_xlabel("step", fontsize=14)
    ax_loss.set_ylabel("training loss", fontsize=14)
    ax_loss.tick_params(labelsize=13)
    fig.tight_layout()
    return fig


def allreduces_figure(reduced: dict[bool, list[list[int]]]):
    """One optimizer step of k micro-batches, without and with ``no_sync()``:
    ``reduced[use_no_sync][i]`` lists the bytes of each bucket that DDP all-reduced in
    micro-batch i's backward. Narrow, so that a phone shows it at a readable size."""
    import matplotlib.pyplot as plt

    k = len(reduced[True])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for band, use_no_sync in enumerate((False, True)):
        y = -1.9 * band
        calls = sum(len(b) for b in reduced[use_no_sync])
        sent = sum(sum(b) for b in reduced[use_no_sync]) / 1e6
        name = "with no_sync(), lab 3" if use_no_sync else "without no_sync()"
        ax.text(0, y + 1.12, f"{name}:", fontsize=14, weight="bold")
        ax.text(
            1.25 * k - 0.15,
            y + 1.12,
            f"{calls} all-reduce{'s' * (calls != 1)}, {sent:.2f} MB",
            fontsize=14,
            ha="right",
        )
        for i, buckets in enumerate(reduced[use_no_sync]):
            x = 1.25 * i
            ax.add_patch(plt.Rectangle((x, y + 0.5), 1.1, 0.45, fc=COMPUTE))
            label = f"micro {i + 1}"
            ax.text(x + 0.55, y + 0.72, label, ha="center", va="center", fontsize=13)
            if buckets:
                ax.add_patch(plt.Rectangle((x, y), 1.1, 0.42, fc=REDUCE))
                ax.text(
                    x + 0.55,
                    y + 0.21,
                    f"{sum(buckets) / 1e6:.2f} MB",
                    ha="center",
                    va="center",
                    fontsize=13,
                    color="white",
                    weight="bold",
                )
    ax.add_patch(plt.Rectangle((0, -2.75), 0.5, 0.3, fc=REDUCE))
    note = "an all-reduce of the gradients in that backward"
    ax.text(0.65, -2.6, note, va="center", fontsize=13)
    ax.set_xlim(-0.05, 1.25 * k)
    ax.set_ylim(-2.85, 1.5)
    ax.axis("off")
    fig.tight_layout()
    return fig
