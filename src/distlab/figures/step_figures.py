"""The step model's pictures (book/ddp_scaling.md), drawn by its own code: the
efficiency against the batch, one step on a timeline, and the all-reduce algorithms'
costs against the message size.

    efficiency_figure(cfg, 8, GPU_FLOPS)
    timeline_widget(cfg, 8, GPU_LINKS["400 Gb/s network"], GPU_FLOPS)
"""

from __future__ import annotations

from distlab.costs import collectives as nccl
from distlab.infra.stepper import figure_html, stepper
from distlab.model import GPTConfig
from distlab.tools.step_model import (
    GPU_LINKS,
    Link,
    MiB,
    compute_seconds,
    ddp_schedule,
    ddp_step,
    efficiency,
    smallest_batch,
)

COLORS = ("#3b6ea5", "#e39b4c", "#c0504d", "#6a9f58")
# one colour per algorithm, the same in both panels
ALGORITHM_COLORS = {
    "ring": "#3b6ea5",
    "ring, LL": "#9b7fc0",
    "tree (a chain)": "#c0504d",
    "tree": "#c0504d",
    "NVLS (switch sums)": "#6a9f58",
    "hierarchical": "#e39b4c",
}
FONT = 12  # read on a phone: few labels, large letters


def efficiency_figure(cfg: GPTConfig, n: int, flops_per_s: float, batches=None):
    """The model's scaling efficiency against the per-GPU batch, one line per GPU link,
    with each link's smallest batch for 90% marked."""
    import matplotlib.pyplot as plt

    batches = batches or [2**k for k in range(0, 10)]
    schedule = ddp_schedule(cfg)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for link, color in zip(GPU_LINKS.values(), COLORS):
        eff = [efficiency(cfg, b, n, link, flops_per_s, schedule) for b in batches]
        ax.plot(batches, eff, "-", color=color, lw=2.5, label=link.name)
        b90 = smallest_batch(cfg, n, link, flops_per_s)
        ax.plot(
            [b90],
            [efficiency(cfg, b90, n, link, flops_per_s, schedule)],
            "o",
            color=color,
            ms=9,
        )
        ax.annotate(
            str(b90),
            (b90, 0.9),
            xytext=(0, -22),
            textcoords="offset points",
            ha="center",
            color=color,
            fontsize=FONT,
            weight="bold",
        )
    ax.axhline(0.9, color="#999", ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches], fontsize=FONT - 1)
    ax.minorticks_off()
    ax.set_ylim(0, 1.02)
    ax.tick_params(labelsize=FONT - 1)
    ax.set_xlabel(f"sequences of {cfg.block_size} tokens per GPU", fontsize=FONT)
    ax.set_ylabel("scaling efficiency", fontsize=FONT)
    ax.set_title(f"model, not measured: {n} H100s", fontsize=FONT)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=FONT - 1, loc="lower right")
    fig.tight_layout()
    return fig


def timeline_figure(cfg: GPTConfig, batch: int, n: int, link: Link, flops_per_s):
    """One step as the model runs it: forward and backward on the compute stream, each
    bucket's all-reduce on the communication stream from the moment it is ready (a
    tick) and the previous one is done; the last bucket, which holds the tied
    embedding, in orange; the exposed time shaded."""
    import matplotlib.pyplot as plt

    buckets, ready = ddp_schedule(cfg)
    compute = compute_seconds(cfg, batch, flops_per_s)
    step = ddp_step(compute, buckets, n, link, ready=ready)
    ms, forward = 1e3, compute / 3  # backward starts when forward ends
    fig, ax = plt.subplots(figsize=(6.4, 2.9))
    ax.barh(1, forward * ms, color="#c9d6e8", height=0.5)
    ax.barh(1, (compute - forward) * ms, left=forward * ms, color=COLORS[0], height=0.5)
    end = (compute + step["exposed"]) * ms
    for label, left, width, color in (
        ("forward", 0, forward, "#333"),
        ("backward", forward, compute - forward, "white"),
    ):
        if width * ms > 0.18 * end:  # only where the word fits
            ax.text(
                (left + width / 2) * ms,
                1,
                label,
                ha="center",
                va="center",
                fontsize=FONT - 1,
                color=color,
            )
    for k, (at, start, end) in enumerate(step["spans"]):
        last = k == len(buckets) - 1
        color = COLORS[1] if last else ("#8fb3d9" if k % 2 else "#5d8cc0")
        ax.barh(
            0,
            (end - start) * ms,
            left=(forward + start) * ms,
            color=color,
            height=0.5,
            edgecolor="white",
            lw=0.5,
        )
        ax.plot([(forward + at) * ms] * 2, [0.68, 0.78], color="#333", lw=1)
    if step["exposed"] > 0:
        ax.axvspan(
            compute * ms,
            (compute + step["exposed"]) * ms,
            color=COLORS[2],
            alpha=0.18,
            lw=0,
        )
        ax.text(
            (compute + step["exposed"] / 2) * ms,
            1.45,
            f"exposed\n{step['exposed'] * ms:.1f} ms",
            ha="center",
            va="center",
            fontsize=FONT - 1,
            color=COLORS[2],
        )
    ax.set_yticks([0, 1], ["all-reduce", "compute"], fontsize=FONT)
    ax.set_ylim(-0.45, 1.8)
    ax.tick_params(axis="x", labelsize=FONT - 1)
    ax.set_xlabel("ms", fontsize=FONT)
    ax.set_title(
        f"{batch} sequence{'s' if batch > 1 else ''} per GPU: efficiency "
        f"{step['efficiency']:.0%}",
        fontsize=FONT,
    )
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def timeline_widget(cfg, n, link, flops_per_s, batches=(1, 2, 4, 8, 16, 32, 64), at=5):
    """The timeline at each batch, behind a slider and a play button, rendered in
    advance: no kernel needed (the ring widget of book/collectives.md works the same
    way)."""
    views = [
        figure_html(timeline_figure(cfg, b, n, link, flops_per_s)) for b in batches
    ]
    return stepper(views, "sequences", start=at, options=[str(b) for b in batches])


def algorithms_figure(nic_bandwidth: float = 50e9, sizes=None):
    """The all-reduce's time per algorithm against the message size: one node of 8
    H100s, and 4 nodes of 8 with a NIC per GPU. DDP's bucket sizes shaded."""
    import matplotlib.pyplot as plt

    sizes = sizes or [2.0**k for k in range(10, 33)]  # 1 KiB ... 4 GiB
    panels = [
        ("one node, 8 GPUs", nccl.algorithms_one_node),
        (
            "4 nodes x 8 GPUs, 400 Gb/s NIC per GPU",
            lambda s: nccl.algorithms_across_nodes(s, 4, 8, nic_bandwidth),
        ),
    ]
    fig, axes = plt.subplots(2, 1, figsize=(6.4, 8))
    for ax, (title, costs) in zip(axes, panels):
        table = [costs(s) for s in sizes]
        for name in table[0]:
            color = ALGORITHM_COLORS[name]
            ax.plot(
                [s / MiB for s in sizes],
                [row[name] * 1e6 for row in table],
                color=color,
                lw=2.2,
                label=name,
            )
        ax.axvspan(1, 27, color="#999", alpha=0.15, lw=0)
        ax.text(
            5,
            ax.get_ylim()[1] * 0.5,
            "DDP's\nbuckets",
            ha="center",
            fontsize=FONT - 1,
            color="#555",
        )
        ax.set(xscale="log", yscale="log")
        ax.tick_params(labelsize=FONT - 1)
        ax.set_xlabel("message size (MiB)", fontsize=FONT)
        ax.set_ylabel("time (µs)", fontsize=FONT)
        ax.set_title(f"model, not measured: {title}", fontsize=FONT)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=FONT - 1, loc="upper left")
    fig.tight_layout()
    return fig
