"""DistributedSampler's rule rebuilt by hand, and its deal drawn.

``expected_shards`` is the rule written out (pad or cut one common order, then deal it
out with a stride); the chapter "Feeding the ranks" and its tests hold it against
PyTorch's own ``DistributedSampler`` over many sizes. ``deal_views`` draws the
deal position by position (views rendered in advance, so the built page needs no
kernel); ``deal_figure`` compares padding and dropping. Both draw from the real sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data.distributed import DistributedSampler

RANK_COLORS = ["#3b6ea5", "#e39b4c", "#5aa469", "#b05fa8"]
REPEAT = "#c0392b"  # the frame of a padded position: a sample dealt a second time


@dataclass(frozen=True)
class SamplerLayout:
    per_rank: int  # indices each rank yields per epoch: len(sampler)
    # per_rank * world_size: indices handed out per epoch, all ranks together
    total: int
    padded: int  # indices repeated to reach total (drop_last=False)
    dropped: int  # indices left out of the epoch (drop_last=True)


def expected_layout(n: int, world_size: int, drop_last: bool) -> SamplerLayout:
    """The sizes DistributedSampler settles on, from the rule alone."""
    if drop_last:
        per_rank = n // world_size  # round down: the tail of the order is cut off
    else:
        per_rank = -(-n // world_size)  # round up: the order is padded from its start
    total = per_rank * world_size
    return SamplerLayout(
        per_rank, total, padded=max(0, total - n), dropped=max(0, n - total)
    )


def epoch_order(n: int, epoch: int, shuffle: bool = True, seed: int = 0) -> list[int]:
    """The order all ranks agree on before sharding: a permutation seeded by seed
    + epoch."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(
        n, generator=torch.Generator().manual_seed(seed + epoch)
    ).tolist()


# --- begin rule ---
def padded_order(order: list[int], world_size: int, drop_last: bool) -> list[int]:
    """The order padded from its start (cycling when more than len(order) are
    missing) or cut, to a multiple of ``world_size``."""
    total = expected_layout(len(order), world_size, drop_last).total
    full = list(order)
    while len(full) < total:
        full += order[: total - len(full)]
    return full[:total]


def expected_shards(
    order: list[int], world_size: int, drop_last: bool
) -> list[list[int]]:
    """DistributedSampler's rule written out: pad or cut ``order``, then deal it out.

    Rank r takes positions r, r + N, r + 2N, ...: a strided deal, not a contiguous
    block.
    """
    full = padded_order(order, world_size, drop_last)
    return [full[r::world_size] for r in range(world_size)]


# --- end rule ---


def real_shards(n: int, world_size: int, drop_last: bool = False) -> list[list[int]]:
    """Epoch 0 of PyTorch's sampler, one per rank (no process group needed)."""
    return [
        list(DistributedSampler(range(n), world_size, r, drop_last=drop_last))
        for r in range(world_size)
    ]


# ------------------------------------------------------------------ the deal, stepped
def _cell(text, fill: str = "#eeeeee", frame: str = "white", color: str = "#222"):
    style = (
        f"background:{fill};color:{color};border:3px solid {frame};width:1.75em;"
        "height:1.9em;text-align:center;font-family:monospace;font-size:1em;padding:0"
    )
    return f"<td style='{style}'>{text}</td>"


def deal_html(n: int, world_size: int, dealt: int) -> str:
    """The deal after ``dealt`` positions: the common order on top, each rank's
    indices below, the last position dealt framed in black."""
    order = padded_order(epoch_order(n, 0), world_size, drop_last=False)
    shards = real_shards(n, world_size)
    assert shards == expected_shards(epoch_order(n, 0), world_size, False)
    color = [RANK_COLORS[p % world_size % len(RANK_COLORS)] for p in range(len(order))]

    def frame(p):  # the position just dealt in black, the repeats in red
        last = p == dealt - 1 and dealt < len(order)
        return "#111" if last else (REPEAT if p >= n else "white")

    top = "".join(
        _cell(
            i,
            color[p] if p < dealt else "#eeeeee",
            frame(p),
            "white" if p < dealt else "#222",
        )
        for p, i in enumerate(order)
    )
    head = "<th style='text-align:right;padding:0 .4em 0 0;font-size:.9em'>{}</th>"
    numbers = "".join(
        f"<td style='text-align:center;color:#888;font-size:.75em'>{p}</td>"
        for p in range(len(order))
    )
    rows = [f"<tr>{head.format('position')}{numbers}</tr>"]
    rows.append(f"<tr>{head.format('order')}{top}</tr>")
    for r, shard in enumerate(shards):
        cells = "".join(
            _cell(i, color[p], frame(p), "white")
            if (p := r + j * world_size) < dealt
            else _cell("")
            for j, i in enumerate(shard)
        )
        rows.append(f"<tr>{head.format(f'rank {r}')}{cells}</tr>")
    if dealt == 0:
        what = (
            f"Every rank computes the same order of the {n} indices (a permutation "
            f"seeded with seed + epoch) and pads it to {len(order)}, a multiple of "
            f"{world_size}, by repeating its start (red frames)."
        )
    elif dealt < len(order):
        p = dealt - 1
        what = f"Position {p} (sample {order[p]}) goes to rank {p % world_size}."
        if p >= n:
            what += f" It repeats position {p - n}: sample {order[p]} is seen twice."
    else:
        what = (
            f"Dealt. Rank r holds positions r, r+{world_size}, r+{2 * world_size}: "
            "each rank row is what its DistributedSampler yields."
        )
    table = f"<table style='border-collapse:collapse'>{''.join(rows)}</table>"
    return (
        f"<div style='font-size:1em'><p style='min-height:3em'>{what}</p>{table}</div>"
    )


def deal_views(n: int = 10, world_size: int = 4) -> list[str]:
    """The deal, one HTML view per index dealt (``distlab.infra.stepper`` steps through
    them, as the collectives chapter's ring)."""
    steps = expected_layout(n, world_size, drop_last=False).total + 1
    return [deal_html(n, world_size, k) for k in range(steps)]


# --------------------------------------------------------------- pad or drop, drawn
def deal_figure(n: int = 10, world_size: int = 4):
    """Epoch 0's order padded (drop_last=False) and cut (drop_last=True), each
    position coloured by the rank it goes to; from the real sampler's shards."""
    import matplotlib.pyplot as plt

    order = epoch_order(n, 0)
    width = expected_layout(n, world_size, False).total
    fig, axes = plt.subplots(2, 1, figsize=(7, 3.4))
    for ax, drop_last in zip(axes, (False, True)):
        layout = expected_layout(n, world_size, drop_last)
        full = padded_order(order, world_size, drop_last)
        # every rank's real shard, laid back on the positions it was dealt from
        shards = real_shards(n, world_size, drop_last)
        assert shards == [full[r::world_size] for r in range(world_size)]
        shown = order if drop_last else full  # the cut tail stays visible, in grey
        for pos, idx in enumerate(shown):
            dealt = pos < layout.total
            fill = RANK_COLORS[pos % world_size] if dealt else "#dddddd"
            repeat = pos >= n
            ax.add_patch(
                plt.Rectangle(
                    (pos, 0),
                    0.9,
                    0.9,
                    fc=fill,
                    ec=REPEAT if repeat else "none",
                    lw=3,
                    hatch="//" if repeat else None,
                )
            )
            ax.text(
                pos + 0.45,
                0.45,
                str(idx),
                ha="center",
                va="center",
                fontsize=14,
                color="white" if dealt else "#666",
                weight="bold",
            )
        note = (
            f"samples {', '.join(map(str, full[n:]))} dealt twice"
            if layout.padded
            else f"samples {', '.join(map(str, order[layout.total :]))} not dealt"
        )
        ax.text(0, 1.15, f"drop_last={drop_last}: {note}", fontsize=13)
        ax.set_xlim(-0.1, width + 0.1)
        ax.set_ylim(-0.1, 1.7)
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c) for c in RANK_COLORS[:world_size]]
    fig.legend(
        handles,
        [f"rank {r}" for r in range(world_size)],
        loc="lower center",
        ncol=world_size,
        frameon=False,
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig
