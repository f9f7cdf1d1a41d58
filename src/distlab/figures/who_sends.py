"""Who sends what to whom in one training step, drawn from counted collectives.

The input is what ``distlab.chapters.fsdp_communication.volumes`` returns on each
rank: per strategy, the ``Call``s that ``collective_bytes.CollectiveBytes`` counted in
each phase (forward, backward, optimizer step), each with its kind, its tensor bytes
and the ranks of its group. Nothing here knows a strategy's schedule: the
bars and the groups are the counted calls.

    segments(record)               # [(phase, kind, group's ranks, Psi sent), ...]
    bytes_figure(volumes, marks)   # the bytes each rank sends, stacked by collective
    group_figure(records, name)    # the groups each phase talks in, on 4 ranks
"""

from __future__ import annotations

from collections import defaultdict

from distlab.costs.collectives import ring_bytes_sent
from distlab.tools.collective_bytes import Call

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "broadcast")
COLOURS = {
    "all-gather": "#1f77b4",
    "reduce-scatter": "#ff7f0e",
    "all-reduce": "#2ca02c",
    "broadcast": "#9467bd",
}
PHASE_LABEL = {"forward": "fwd", "backward": "bwd", "step": "step"}
# where rank r sits in the drawings: the (2, 2) mesh row by row, replicas down
POSITION = {0: (0, 1), 1: (1, 1), 2: (0, 0), 3: (1, 0)}


def two_lines(name: str) -> str:
    """ "ZeRO-3 (FSDP2 True)" -> its name over its bracket."""
    return name.replace(" (", "\n(")


def ring_bytes(call: Call) -> float:
    """What this rank sends for one call on a ring (``RING_FACTOR``)."""
    return ring_bytes_sent(call.kind, call.tensor_bytes, call.group_size)


def segments(record: dict) -> list[tuple[str, str, tuple, float]]:
    """(phase, kind, one group's ranks, Psi this rank sent) in phase order, calls of
    the same phase, kind and group summed."""
    out = []
    for phase, calls in record["phases"].items():
        total: dict[tuple, float] = defaultdict(float)
        for call in calls:
            total[(call.kind, call.ranks)] += ring_bytes(call)
        for (kind, ranks), sent in total.items():
            out.append((phase, kind, ranks, sent / record["psi"]))
    return out


def sent_psi(record: dict) -> float:
    """Psi this rank sends per step on a ring, every phase."""
    return sum(s for *_, s in segments(record))


def bytes_figure(volumes: dict, marks: dict[str, float]):
    """One bar per strategy, its name above it: the Psi each rank sends per step, a
    segment per collective (colour: kind; label: phase), with the textbook's figures
    as dotted lines. Narrow and tall, with few large labels: it is read on phones."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    font = 16
    names = list(volumes)
    fig, ax = plt.subplots(figsize=(5, 0.78 * len(names) + 1.9))
    for row, name in enumerate(names):
        ax.text(0, row - 0.32, name, ha="left", va="bottom", fontsize=font,
                bbox={"color": "white", "pad": 0}, zorder=3)  # fmt: skip
        left = 0.0
        for phase, kind, _, psi in segments(volumes[name]):
            ax.barh(row, psi, left=left, height=0.5, color=COLOURS[kind])
            ax.barh(row, psi, left=left, height=0.5, fill=False, edgecolor="white")
            if psi > 0.3:
                label = PHASE_LABEL[phase]
                ax.text(left + psi / 2, row, label, ha="center", va="center",
                        color="white", fontsize=font)  # fmt: skip
            left += psi
    for text, x in marks.items():
        ax.axvline(x, color="black", linestyle=":", linewidth=1.5)
        ax.text(x, -1.0, text, ha="center", va="bottom", fontsize=font)
    ax.set_yticks([])
    ax.set_xlim(0, 1.05 * max(sent_psi(v) for v in volumes.values()))
    ax.set_ylim(len(names) - 0.6, -1.05)
    ax.set_xlabel("Ψ each rank sends per step", fontsize=font)
    ax.tick_params(axis="x", labelsize=font)
    ax.spines[["top", "right", "left"]].set_visible(False)
    seen = {kind for v in volumes.values() for _, kind, _, _ in segments(v)}
    handles = [Patch(color=COLOURS[k], label=k) for k in KINDS if k in seen]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=font,
               frameon=False, handlelength=1, columnspacing=1)  # fmt: skip
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    return fig


def _groups(records: list[dict], phase: str) -> dict[tuple, dict[str, float]]:
    """Every group any rank talked in during ``phase``: its ranks -> kind -> the Psi
    one of its ranks sent there (rank 0's, or the group's first rank's)."""
    groups: dict[tuple, dict[str, float]] = defaultdict(dict)
    for record in records:
        for kind, ranks, psi in [
            (k, g, p) for ph, k, g, p in segments(record) if ph == phase
        ]:
            groups[ranks].setdefault(kind, psi)
    return groups


def _ring(ax, ranks, kind: str) -> None:
    """The group as the ring its bytes travel: a line between two ranks, a loop
    around more; each kind a little apart so that two on one group both show."""
    import math

    points = [POSITION[r] for r in ranks]
    cx = sum(x for x, _ in points) / len(points)
    cy = sum(y for _, y in points) / len(points)
    shift = 0.1 * (KINDS.index(kind) - 1)
    if len(points) == 2:
        (x0, y0), (x1, y1) = points
        length = math.hypot(x1 - x0, y1 - y0)
        dx, dy = -(y1 - y0) / length * shift, (x1 - x0) / length * shift
        xs, ys = [x0 + dx, x1 + dx], [y0 + dy, y1 + dy]
    else:
        points.sort(key=lambda p: math.atan2(p[1] - cy, p[0] - cx))
        scale = 1.25 + 2 * shift
        xs = [cx + (x - cx) * scale for x, _ in points + points[:1]]
        ys = [cy + (y - cy) * scale for _, y in points + points[:1]]
    ax.plot(xs, ys, color=COLOURS[kind], linewidth=4, solid_capstyle="round")


def group_figure(records: list[dict], name: str):
    """Three rows (forward, backward, optimizer step) of one strategy: the 4 ranks at
    their mesh places, each group a collective ran in as its ring (colour: kind),
    and beside them what each rank sent in that phase, in Psi. One column, large
    labels: it is read on phones."""
    import matplotlib.pyplot as plt

    font = 17
    fig, axes = plt.subplots(3, 1, figsize=(5, 6.4))
    for ax, phase in zip(axes, ("forward", "backward", "step")):
        groups = _groups(records, phase)
        lines = defaultdict(float)
        for ranks, kinds in sorted(groups.items()):
            for kind in kinds:
                _ring(ax, ranks, kind)
        for kind, psi in (
            (k, p) for r in records[:1] for ph, k, _, p in segments(r) if ph == phase
        ):
            lines[kind] += psi
        for rank, (x, y) in POSITION.items():
            ax.scatter(x, y, s=600, color="white", edgecolor="black", zorder=3)
            ax.text(x, y, str(rank), ha="center", va="center", fontsize=font, zorder=4)
        title = phase if phase != "step" else "optimizer step"
        ax.text(2.0, 1.35, title, ha="left", va="top", fontsize=font,
                fontweight="bold")  # fmt: skip
        for i, (kind, psi) in enumerate(lines.items()):
            ax.text(2.0, 0.85 - 0.45 * i, f"{kind}: {psi:.2f} Ψ", ha="left",
                    va="top", color=COLOURS[kind], fontsize=font)  # fmt: skip
        if not lines:
            ax.text(2.0, 0.85, "nothing sent", ha="left", va="top", fontsize=font)
        ax.set_xlim(-0.5, 5.3)
        ax.set_ylim(-0.5, 1.5)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle(name, fontsize=font + 1)
    fig.tight_layout(h_pad=0.2)
    return fig
