"""A row of short labels above a plot, each joined by a line to the x it marks, spread
so that none collide: readable on a phone however close the marked points are.

    label_row(ax, [6, 25, 387], ["r", "0", "5"], ["grey", "grey", "green"],
              [False, False, True], font=16, split=382)
    # labels left of x=382 stay left of it, the others right of it

Call it after the figure's layout (``tight_layout``): it spaces the labels by the axes'
final width. Leave room above the axes, e.g. ``ax.set_title(..., pad=2.2 * font)``.
"""

from __future__ import annotations

import statistics


def spread(xs: list[float], gap: float, lo: float, hi: float) -> list[float]:
    """Positions for sorted ``xs``, at least ``gap`` apart within [lo, hi]: a run of
    labels that would collide is spaced evenly about its targets' mean."""
    runs: list[list] = []  # [first, count, start]
    for i, x in enumerate(xs):
        runs.append([i, 1, min(max(x, lo), hi)])
        while len(runs) > 1 and runs[-2][2] + runs[-2][1] * gap > runs[-1][2]:
            first, n = runs[-2][0], runs[-2][1] + runs[-1][1]
            mid = statistics.mean(xs[first : first + n]) - (n - 1) * gap / 2
            runs[-2:] = [[first, n, min(max(mid, lo), hi - (n - 1) * gap)]]
    return [start + k * gap for _, n, start in runs for k in range(n)]


def label_row(ax, xs, labels, colors, bold, font: float, split: float | None = None):
    """Each label above ``ax`` (bold where ``bold``), a tick at its x on the top edge
    and a line from one to the other. With ``split`` (an x, drawn dashed through the
    row) the labels on each side stay on that side."""
    from matplotlib.transforms import offset_copy

    lo, hi = ax.get_xlim()
    width_pt = 72 * ax.figure.get_figwidth() * ax.get_position().width
    gap = 1.3 * font / width_pt * (hi - lo)  # a digit and as much air
    edge = ax.get_xaxis_transform()  # x: data, y: 0 bottom, 1 top of the axes
    above = offset_copy(edge, fig=ax.figure, y=0.8 * font, units="points")
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    sides = [(lo, hi, order)]
    if split is not None:
        sides = [
            (lo, split, [i for i in order if xs[i] < split]),
            (split, hi, [i for i in order if xs[i] >= split]),
        ]
    placed = {}
    for left, right, side in sides:
        fit = min(gap, (right - left) / max(1, len(side)))  # squeezed to stay inside
        at = spread([xs[i] for i in side], fit, left + fit / 2, right - fit / 2)
        placed.update(zip(side, at))
    for i in order:
        ax.plot([xs[i]] * 2, [0.955, 1], color=colors[i], lw=2, transform=edge)
        ax.annotate(
            labels[i],
            xy=(xs[i], 1),
            xycoords=edge,
            xytext=(placed[i], 1),
            textcoords=above,
            ha="center",
            va="bottom",
            color=colors[i],
            fontsize=font,
            fontweight="bold" if bold[i] else "normal",
            arrowprops={"arrowstyle": "-", "color": colors[i], "lw": 1, "shrinkB": 0},
            annotation_clip=False,
        )
    if split is not None:
        top = offset_copy(edge, fig=ax.figure, y=2 * font, units="points")
        ax.annotate(
            "",
            xy=(split, 1),
            xycoords=edge,
            xytext=(split, 1),
            textcoords=top,
            arrowprops={"arrowstyle": "-", "color": "black", "lw": 0.8, "ls": "--"},
            annotation_clip=False,
        )
