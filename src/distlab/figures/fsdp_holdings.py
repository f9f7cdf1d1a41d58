"""Figures of the from-scratch FSDP's recorded hook trace (``distlab.scratch.fsdp``).

    # what rank 0 holds of each unit, event by event: a stepper
    holdings_widget(trace, sizes)
    # the step on a time axis, resharding beside keeping (the gathered bytes below)
    timeline(trace_reshard, trace_keep)

``sizes`` is ``{unit: (full_bytes, shard_bytes)}``, from the units' real parameter
counts. Nothing here times anything for a claim: the time axis only places events.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from distlab.infra.stepper import stepper

KB = 1024
COLORS = {
    "all-gather": "#e39b4c",
    "forward": "#3b6ea5",
    "backward": "#8fb4dc",
    "reduce-scatter": "#5aa469",
}
SHARD, GATHERED, EMPTY = "#444444", "#e39b4c", "#f2f2f2"


def frames(trace: list) -> list[tuple[str, str, str, set[str]]]:
    """One frame per event: (phase, unit, what, the units gathered after it)."""
    gathered, out, phase = set(), [], "forward"
    for e in trace:
        if e.what == "all-gather":
            gathered.add(e.unit)
        elif e.what == "free":
            gathered.discard(e.unit)
        out.append((phase, e.unit, e.what, set(gathered)))
        if e.unit == "root" and e.what == "forward":  # the model's forward is over
            phase = "backward"
    return out


def frame_figure(frame: tuple, sizes: dict, n: int):
    """Every unit as a bar as long as its full parameters: the rank's own 1/N (dark)
    always there, the rest (orange) only while the unit is gathered."""
    phase, unit, what, gathered = frame
    names = list(sizes)
    fig, ax = plt.subplots(figsize=(5.2, 1.0 + 0.6 * len(names)))
    for row, name in enumerate(names):
        full, shard = (b / KB for b in sizes[name])
        ax.barh(row, full, color=GATHERED if name in gathered else EMPTY, height=0.6)
        ax.barh(row, shard, color=SHARD, height=0.6)
        ax.barh(row, full, fill=False, edgecolor="#999999", height=0.6)
    ax.set_yticks(range(len(names)), names, fontsize=14)
    for label, name in zip(ax.get_yticklabels(), names):
        if name == unit:
            label.set_fontweight("bold")
            label.set_color(COLORS.get(what, "#444444"))
    ax.invert_yaxis()
    held = sum(sizes[name][0] for name in gathered) / KB
    ax.set_title(
        f"{phase}: {what} of {unit}\n{held:.0f} KiB gathered",
        fontsize=15,
        loc="left",
    )
    ax.set_xlabel(f"KiB (dark: this rank's 1/{n})", fontsize=14)
    ax.tick_params(axis="x", labelsize=13)
    fig.tight_layout()
    return fig


def holdings_widget(trace: list, sizes: dict, n: int, start: int = 0):
    """The frames of one step behind a Play button and a slider (no kernel needed)."""
    views = [frame_figure(f, sizes, n) for f in frames(trace)]
    return stepper(views, "event", start=start)


def _held_intervals(events: list) -> list[tuple[float, float]]:
    held, start = [], None
    for e in events:
        if e.what == "all-gather":
            start = e.start
        elif e.what == "free" and start is not None:
            held.append((start, e.end))
            start = None
    return held


def _draw(ax_lanes, ax_bytes, events: list, units: list[str], title: str) -> None:
    t0 = events[0].start

    def ms(t):
        return 1e3 * (t - t0)

    for lane, unit in enumerate(units):
        mine = [e for e in events if e.unit == unit]
        for start, end in _held_intervals(mine):
            ax_lanes.broken_barh(
                [(ms(start), ms(end) - ms(start))], (lane - 0.42, 0.84), color="#e6e6e6"
            )
        for e in mine:
            if e.what in COLORS:
                width = max(ms(e.end) - ms(e.start), 0.02)
                ax_lanes.broken_barh(
                    [(ms(e.start), width)], (lane - 0.25, 0.5), color=COLORS[e.what]
                )
    ax_lanes.set_yticks(range(len(units)), units, fontsize=15)
    ax_lanes.invert_yaxis()  # the root on top: its forward encloses the blocks'
    ax_lanes.set_title(title, fontsize=16)
    ax_bytes.step(
        [ms(e.end) for e in events],
        [e.gathered_bytes / KB for e in events],
        where="post",
        color="#444444",
    )
    ax_bytes.set_xlabel("ms into the step (rank 0)", fontsize=15)
    ax_bytes.set_ylabel("KiB", fontsize=15)
    for ax in (ax_lanes, ax_bytes):
        ax.tick_params(labelsize=14)
    ax_bytes.yaxis.set_major_locator(plt.MaxNLocator(3))


def timeline(reshard: list, keep: list, units: list[str]):
    """Rank 0's step, resharding after forward (top) and keeping (bottom): each unit's
    all-gathers, computations and reduce-scatters, grey while it is gathered; under
    each, the gathered KiB. Stacked, 6.4 in wide, for a phone."""
    fig, axes = plt.subplots(
        4, 1, figsize=(6.4, 9.6), gridspec_kw={"height_ratios": [2, 1, 2, 1]}
    )
    _draw(axes[0], axes[1], reshard, units, "reshard_after_forward=True")
    _draw(axes[2], axes[3], keep, units, "reshard_after_forward=False")
    for lanes, nums in ((axes[0], axes[1]), (axes[2], axes[3])):
        nums.sharex(lanes)
        lanes.tick_params(labelbottom=False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in [*COLORS.values()]]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#e6e6e6"))
    fig.legend(
        handles,
        [*COLORS, "gathered"],
        loc="lower center",
        ncol=3,
        frameon=False,
        fontsize=15,
        handlelength=1.2,
        columnspacing=1.0,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
