"""The key figure of book/fsdp_big_models.md: the bytes each rank holds at each stage of
a big model's life (built on ``meta``, ``to_empty``, a full state dict loaded from rank
0, one saved to rank 0), from what the page's run measured
(``distlab.chapters.fsdp_big_models.tour``)."""

from __future__ import annotations

SHARDS = "#1f77b4"  # the rank's own shards
WHOLE = "#ff7f0e"  # the whole model's dict, on rank 0 only
IN_FLIGHT = "#d62728"  # full tensors received or gathered, one at a time


def stages(results: list[dict]) -> dict[str, list[tuple[int, int, int]]]:
    """``{stage: [(shards, whole dict, in flight) bytes of rank 0, of rank 1, ...]}``
    from the tour's results; the load and save stages are the peaks that
    ``MemTracker`` saw during the call."""
    out = {"built on meta": [], "to_empty": [], "load (peak)": [], "save (peak)": []}
    for r in results:
        shards = r["load"]["shard bytes"]
        load_dict, save_dict = r["load"]["dict bytes"], r["save"]["dict bytes"]
        out["built on meta"].append((r["meta bytes"], 0, 0))
        out["to_empty"].append((shards, 0, 0))
        load_extra = r["load"]["peak"] - shards - load_dict
        out["load (peak)"].append((shards, load_dict, load_extra))
        save_extra = r["save"]["peak"] - shards - save_dict
        out["save (peak)"].append((shards, save_dict, save_extra))
    return out


def load_path_figure(results: list[dict], whole_bytes: int):
    """Stacked bars, one per rank and stage, in KiB; a dashed line at the whole
    model's parameters (``whole_bytes``, as one process holds them). Narrow, with
    large labels: it is read on phones."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    font = 16
    data = stages(results)
    n = len(results)
    fig, ax = plt.subplots(figsize=(5, 5.4))
    ticks, labels = [], []
    below = ax.get_xaxis_transform()  # x: data, y: axes fraction
    for group, (stage, ranks) in enumerate(data.items()):
        for rank, parts in enumerate(ranks):
            x = group * (n + 1) + rank
            bottom = 0.0
            for part, color in zip(parts, (SHARDS, WHOLE, IN_FLIGHT)):
                ax.bar(x, part / 1024, bottom=bottom, color=color, width=0.85)
                bottom += part / 1024
            ticks.append(x)
            labels.append(f"r{rank}")
            if bottom == 0:  # nothing allocated: say so
                ax.text(x, 8, "0", ha="center", va="bottom", fontsize=font)
        middle = group * (n + 1) + (n - 1) / 2
        name = stage.replace(" (", "\n(").replace("built on ", "")
        ax.text(middle, -0.1, name, ha="center", va="top", fontsize=font,
                transform=below)  # fmt: skip
    ax.axhline(whole_bytes / 1024, ls="--", color="black", lw=1)
    ax.text(-0.4, whole_bytes / 1024 * 1.03, "the whole model", fontsize=font)
    ax.set_xticks(ticks, labels, fontsize=font - 2)
    ax.tick_params(axis="x", length=0)
    ax.tick_params(axis="y", labelsize=font - 2)
    ax.set_ylabel("KiB on the rank", fontsize=font)
    ax.spines[["top", "right"]].set_visible(False)
    handles = [
        Patch(color=SHARDS, label="its shards"),
        Patch(color=WHOLE, label="whole dict (rank 0)"),
        Patch(color=IN_FLIGHT, label="one full tensor"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=font - 1,
               frameon=False, handlelength=1, columnspacing=1)  # fmt: skip
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    return fig


def broadcast_step_figure(results: list[dict], k: int):
    """The load by broadcast after tensor ``k`` of the dict arrived. Top: the dict's
    tensors, each as wide as its bytes: loaded (grey), arriving (red), to come
    (white). Below: each rank's bytes at that moment: its shards, rank 0's whole
    dict, and rank 1's receive buffer of the whole tensor ``k``. Narrow, with large
    labels: it is read on phones."""
    import matplotlib.pyplot as plt

    font = 15
    tensors = results[0]["load"]["tensors"]
    name, whole, _ = tensors[k]
    fig, (strip, ax) = plt.subplots(
        2, 1, figsize=(5, 3.6), gridspec_kw={"height_ratios": [0.5, 1.4]}
    )
    left = 0.0
    for j, (_, size, _) in enumerate(tensors):
        color = "#bbbbbb" if j < k else IN_FLIGHT if j == k else "white"
        strip.barh(0, size / 1024, left=left, color=color, edgecolor="black", lw=0.5)
        left += size / 1024
    strip.set_axis_off()
    strip.set_title(f"tensor {k + 1} of {len(tensors)}\n{name}", fontsize=font)
    for rank, r in enumerate(results):
        parts = (
            r["load"]["shard bytes"],
            r["load"]["dict bytes"],
            0 if rank == 0 else whole,  # rank 0 sends its own tensor
        )
        left = 0.0
        for part, color in zip(parts, (SHARDS, WHOLE, IN_FLIGHT)):
            ax.barh(rank, part / 1024, left=left, color=color)
            left += part / 1024
    peak = max(r["load"]["shard bytes"] + r["load"]["dict bytes"] for r in results)
    ax.set_xlim(0, peak / 1024 * 1.05)
    ax.set_yticks(range(len(results)), [f"rank {r}" for r in range(len(results))])
    ax.tick_params(labelsize=font)
    ax.invert_yaxis()
    ax.set_xlabel("KiB on the rank", fontsize=font)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def broadcast_stepper(results: list[dict]):
    """``broadcast_step_figure`` for every tensor, behind a Play button and a slider
    (``distlab.infra.stepper``): it steps offline in the built page."""
    from distlab.infra.stepper import figure_html, stepper

    # each figure drawn as a PNG and closed at once: 29 open figures would warn
    views = [
        figure_html(broadcast_step_figure(results, k))
        for k in range(len(results[0]["load"]["tensors"]))
    ]
    names = [str(k + 1) for k in range(len(views))]  # as the titles count
    return stepper(views, "tensor", interval_ms=700, options=names)
