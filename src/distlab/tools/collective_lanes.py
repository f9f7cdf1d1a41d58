"""Which collectives each rank ran, in order, and which Python call issued each one.

The process group's flight recorder keeps every collective a rank issues (its kind and
sizes), C++ ones included: DDP's gradient buckets, its construction-time broadcasts.
``CollectiveLog`` reads it, tags each entry with the Python call that issued it (a
wrapper around the functions you name) and cuts the run into phases at the marks you
set. ``lanes_figure`` draws two or more ranks' phases side by side: collectives pair
up by position, so the n-th box of every lane is one collective.

    enable_flight_recorder()                  # before init_process_group
    log = CollectiveLog()
    log.tag(model, "_find_common_rank", "whose copy?")
    ...; log.mark("step 1")                   # after each step
    phases = log.phases(default=lambda op: "bucket")   # on every rank
    lanes_figure([phases_of_rank_0, phases_of_rank_1])
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import torch

FR_ENV = "TORCH_FR_BUFFER_SIZE"


def enable_flight_recorder(entries: int = 2000) -> None:
    """Keep the last ``entries`` collectives of every process group made after this
    call (gloo and NCCL)."""
    os.environ[FR_ENV] = str(entries)


def recorded() -> list[tuple[str, int]]:
    """(kind, numbers) of every collective this process has issued, oldest first:
    ``("all_reduce", 4)``."""
    trace = pickle.loads(
        torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False)
    )
    return [
        (
            e["profiling_name"].split(":")[-1],
            sum(torch.Size(s).numel() for s in e["input_sizes"]),
        )
        for e in trace["entries"]
    ]


class CollectiveLog:
    """The collectives of this rank from now on, tagged and cut into phases."""

    def __init__(self):
        self.start = len(recorded())
        # (first entry, entry after the last, label) of each tagged call
        self.tags: list[tuple[int, int, str]] = []
        self.marks: list[tuple[str, int]] = []
        self._patched: list[tuple[object, str, object]] = []

    def tag(
        self, owner, name: str, label: str, starts_phase: str = "", ends_phase: str = ""
    ) -> None:
        """Label the collectives that ``owner.name(...)`` issues. ``starts_phase``: a
        call first closes the collectives since the last mark, if any, into a phase of
        that name; ``ends_phase``: a call closes them after it returns (``{n}`` in the
        name is the phase's number)."""
        fn = getattr(owner, name)

        def tagged(*args, **kwargs):
            if starts_phase and self._last_mark() < len(recorded()):
                self.mark(starts_phase.format(n=len(self.marks) + 1))
            begin = len(recorded())
            try:
                return fn(*args, **kwargs)
            finally:
                self.tags.append((begin, len(recorded()), label))
                if ends_phase:
                    self.mark(ends_phase.format(n=len(self.marks) + 1))

        self._patched.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, tagged)

    def restore(self) -> None:
        """Undo every ``tag``."""
        for owner, name, original in reversed(self._patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._patched.clear()

    def _last_mark(self) -> int:
        return self.marks[-1][1] if self.marks else self.start

    def mark(self, phase: str) -> None:
        """Close the collectives since the last mark into a phase named ``phase``."""
        self.marks.append((phase, len(recorded())))

    def phases(self, default: Callable[[str], str]) -> list[tuple[str, list[tuple]]]:
        """[(phase, [(kind, numbers, label), ...]), ...]; an entry no tag covers gets
        ``default(kind)``, one several tags cover gets the innermost."""
        entries, out, begin = recorded(), [], self.start
        for phase, end in self.marks:
            rows = []
            for i in range(begin, end):
                covering = [t for t in self.tags if t[0] <= i < t[1]]
                kind, numel = entries[i]
                label = (
                    min(covering, key=lambda t: t[1] - t[0])[2]
                    if covering
                    else default(kind)
                )
                rows.append((kind, numel, label))
            out.append((phase, rows))
            begin = end
        return out


# DDP's calls that issue a collective under Join, and their labels in the figure
JOIN_CALLS = {
    "_find_common_rank": "whose copy?",
    "_sync_module_buffers": "buffers",
    "_check_global_requires_backward_grad_sync": "sync grads?",
    "_match_all_reduce_for_bwd_pass": "zeros",
    "_sync_final_model": "final model",
}
LANE_COLORS = {
    "I'm here": "#cfe3f7",
    "sync grads?": "#cfe3f7",
    "grad bucket": "#b9e3b0",
    "bucket order": "#eeeeee",
    "how many left?": "#fdd0a2",
    "zeros": "#fdd0a2",
    "whose copy?": "#e6dcf5",
    "buffers": "#e6dcf5",
    "final model": "#e6dcf5",
}


def tag_ddp_join(log: CollectiveLog, model) -> None:
    """Tag what a DDP ``model`` and ``Join`` issue (``JOIN_CALLS``); each call of
    ``Join._get_num_nonjoined_procs`` after other collectives starts a new phase,
    "step {n}": on a joined rank, one per step it shadows."""
    from torch.distributed.algorithms.join import Join

    log.tag(Join, "notify_join_context", "I'm here")
    log.tag(Join, "_get_num_nonjoined_procs", "how many left?", "step {n}")
    for name, label in JOIN_CALLS.items():
        log.tag(model, name, label)


def untagged(kind: str) -> str:
    """What DDP issues from C++: the gradient buckets, and the new bucket order that
    rank 0 broadcasts once, in the second step."""
    return "grad bucket" if kind == "all_reduce" else "bucket order"


def lanes_figure(
    per_rank: list[list[tuple[str, list[tuple]]]],
    colors: dict[str, str],
    shaded: dict[int, dict[str, str]] | None = None,
    title: str = "",
):
    """One lane per rank, one column per phase, the phase's collectives stacked in
    order. ``shaded[rank]``: the phases to shade in that rank's lane, each with a note
    written under its boxes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    shaded = shaded or {}
    phases = [name for name, _ in per_rank[0]]
    depth = max(len(rows) for lane in per_rank for _, rows in lane)
    ranks = len(per_rank)
    fig, ax = plt.subplots(figsize=(1.7 * len(phases) + 0.9, 0.5 + 0.5 * depth * ranks))
    lane_h = depth + 0.8
    for r, lane in enumerate(per_rank):
        top = r * lane_h
        ax.text(
            0.02,
            top + depth / 2,
            f"rank {r}",
            ha="right",
            va="center",
            fontsize=13,
            weight="bold",
        )
        for c, (name, rows) in enumerate(lane):
            if name in shaded.get(r, {}):
                ax.add_patch(
                    Rectangle(
                        (c + 0.02, top - 0.1),
                        0.96,
                        depth + 0.2,
                        fc="#fff1dc",
                        ec="none",
                        zorder=0,
                    )
                )
                ax.text(
                    c + 0.5,
                    top + len(rows) + 0.2,
                    shaded[r][name],
                    ha="center",
                    va="top",
                    fontsize=11,
                    style="italic",
                    color="#a0522d",
                )
            for k, (_, _, label) in enumerate(rows):
                ax.add_patch(
                    FancyBboxPatch(
                        (c + 0.08, top + k + 0.1),
                        0.84,
                        0.8,
                        boxstyle="round,pad=0.02",
                        fc=colors.get(label, "#dddddd"),
                        ec="0.35",
                    )
                )
                ax.text(
                    c + 0.5,
                    top + k + 0.5,
                    label,
                    ha="center",
                    va="center",
                    fontsize=11.5,
                )
    for c, name in enumerate(phases):
        ax.text(c + 0.5, -0.35, name, ha="center", va="bottom", fontsize=12.5)
    ax.set_xlim(-0.62, len(phases)), ax.set_ylim(ranks * lane_h - 0.7, -1.0)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=12.5)
    fig.tight_layout()
    return fig
