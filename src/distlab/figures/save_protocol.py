"""Pictures of fault tolerance drawn from real runs: a checkpoint save on two ranks,
step by step on one clock, with what a kill at each instant leaves; and a torchrun
restart as a sequence of events over time.

The events come from ``distlab.chapters.fault_tolerance.save_events`` (each rank's save
steps, stamped on the shared monotonic clock, with the folder's files and ``latest``
after each) and ``torchrun_killing_a_rank`` (torchrun's output lines, stamped)."""

from __future__ import annotations

import html

COLOURS = {0: "tab:blue", 1: "tab:orange"}
# the steps of a save, in the order the figure names them
LABELS = {
    ".partial made": "mkdir",
    "barrier": "",
    "shard written": "shard",
    ".metadata written": ".metadata",
    "train_state.json": "json",
    "renamed": "rename",
}
# what each step did, for the stepper's titles
DONE = {
    ".partial made": "made the .partial folder",
    "shard written": "wrote its shard",
    ".metadata written": "wrote .metadata",
    "train_state.json": "wrote train_state.json",
    "renamed": "renamed the folder",
}
# the last steps are short and close together: their labels go on three heights
LIFT = {"train_state.json": 1.05, "renamed": 0.7}


def ordered(events: list[list[dict]]) -> list[dict]:
    """Every rank's events on one list, each with its ``rank``, by the time it ended,
    in ms from the first start."""
    t0 = min(e["start"] for rank in events for e in rank)
    rows = [
        {**e, "rank": r, "t0": (e["start"] - t0) * 1e3, "t1": (e["end"] - t0) * 1e3}
        for r, rank in enumerate(events)
        for e in rank
    ]
    return sorted(rows, key=lambda e: e["t1"])


def save_figure(events: list[list[dict]], cursor: float | None = None):
    """One lane per rank: the save's steps as bars on one clock; underneath, the
    checkpoint that ``latest`` picks at each instant. With ``cursor`` (ms), a line
    there: a kill at that instant."""
    import matplotlib.pyplot as plt

    rows = ordered(events)
    end = max(e["t1"] for e in rows)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for e in rows:
        y = 2 - e["rank"]
        grey = e["name"] == "barrier"
        width = max(e["t1"] - e["t0"], end / 150)
        ax.barh(
            y,
            width,
            left=e["t0"],
            height=0.6,
            color="lightgrey" if grey else COLOURS[e["rank"]],
        )
        if LABELS[e["name"]]:
            ax.text(
                e["t0"] + width / 2,
                y + LIFT.get(e["name"], 0.35),
                LABELS[e["name"]],
                ha="center",
                fontsize=14,
            )
    # the checkpoint latest() picks: from the snapshot after each event
    shown = [(e["t1"], e["latest"]) for e in rows]
    for (t, name), (t_next, _) in zip(shown, [*shown[1:], (end * 1.3, None)]):
        ax.barh(
            0,
            t_next - t,
            left=t,
            height=0.6,
            color="tab:green" if name.endswith("20") else "tab:gray",
            alpha=0.5,
        )
    old, new = shown[0][1], shown[-1][1]
    switch = next(t for t, name in shown if name == new)
    ax.text(switch / 2, 0, f"{old}", ha="center", va="center", fontsize=14)
    ax.text(end * 1.3, 0, new, ha="right", va="center", fontsize=14)
    if cursor is not None:
        ax.axvline(cursor, color="red", lw=2)
        ax.text(
            cursor,
            -0.48,
            "kill",
            color="red",
            ha="center",
            fontsize=14,
            va="top",
            backgroundcolor="white",
        )
    ax.set_yticks([2, 1, 0], ["rank 0", "rank 1", "resume\nfrom"], fontsize=14)
    ax.set_ylim(-0.5, 3.45)
    ax.set_xlim(0, end * 1.3)
    ax.set_xlabel("ms since the save began (this run)", fontsize=14)
    ax.tick_params(axis="x", labelsize=12)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def kill_moments(events: list[list[dict]]) -> list[tuple[str, dict]]:
    """The instants a kill can land, after each step of the save: (title, event)."""
    rows = [e for e in ordered(events) if e["name"] != "barrier"]
    return [(f"after rank {e['rank']} {DONE[e['name']]}", e) for e in rows]


def moment_html(title: str, event: dict) -> str:
    """What is on disk at one instant of the save, and what a resume would take."""
    files = [
        f
        for f in event["files"]
        if not f.startswith(event["latest"] + "/") or f == event["latest"] + "/"
    ]
    listing = html.escape("\n".join(f"  {f}" for f in files))
    return (
        f"<p><b>Killed {html.escape(title)}.</b> On disk:</p>"
        f"<pre>{listing}</pre>"
        f"<p><code>--resume auto</code> takes <b>{event['latest']}</b>.</p>"
    )


def restart_events(lines: list[tuple[float, str]]) -> list[tuple[float, str, str]]:
    """(seconds, lane, label) for the lines of a torchrun run that tell its story:
    each attempt's start, its checkpoints, the kill, the failure torchrun reports, the
    end."""
    found = []
    for t, line in lines:
        if line.startswith("--resume auto"):
            found.append((t, "rank 0", "attempt 0\nstarts"))
        elif line.startswith("checkpoint:"):
            step = line.split("step_")[1][:6].lstrip("0")
            found.append((t, "rank 0", step))
        elif line.startswith("KILLED"):
            found.append((t, "rank 1", "SIGKILL"))
        elif "failed (exitcode" in line and not any(
            lane == "torchrun" for _, lane, _ in found
        ):
            found.append((t, "torchrun", "sees the\nfailure"))
        elif line.startswith("resumed from"):
            found.append((t, "rank 0", "attempt 1\nresumes"))
        elif "final loss" in line:
            found.append((t, "rank 0", "end"))
    return found


def restart_figure(lines: list[tuple[float, str]]):
    """torchrun's restart as a sequence over time: one lane for torchrun, one per
    rank; attempt 0 shaded, then the restart, then attempt 1."""
    import matplotlib.pyplot as plt

    events = restart_events(lines)
    lanes = {"torchrun": 2, "rank 0": 1, "rank 1": 0}
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    t_kill = next(t for t, lane, _ in events if lane == "rank 1")
    t_resume = next(t for t, _, label in events if label.startswith("attempt 1"))
    t_end = events[-1][0]
    ax.axvspan(0, t_kill, color="tab:gray", alpha=0.12)
    ax.axvspan(t_kill, t_resume, color="tab:red", alpha=0.12)
    ax.axvspan(t_resume, t_end, color="tab:green", alpha=0.12)
    ax.text(t_kill / 2, 2.7, "attempt 0", ha="center", fontsize=14)
    ax.text((t_kill + t_resume) / 2, 2.7, "restart", ha="center", fontsize=14)
    ax.text((t_resume + t_end) / 2, 2.7, "attempt 1", ha="center", fontsize=14)
    for t, lane, label in events:
        y = lanes[lane]
        ax.plot(
            t,
            y,
            "X" if label == "SIGKILL" else "o",
            ms=10,
            color="tab:red" if label == "SIGKILL" else "black",
        )
        below = label.startswith(("attempt", "end", "SIGKILL"))
        ax.text(
            t,
            y + (-0.2 if below else 0.15),
            label,
            ha="center",
            va="top" if below else "bottom",
            fontsize=13,
        )
    ax.set_yticks(
        list(lanes.values()), ["torchrun", "rank 0\n(saves)", "rank 1"], fontsize=14
    )
    ax.set_ylim(-0.9, 3.0)
    ax.set_xlim(0, t_end * 1.05)
    ax.set_xlabel("seconds since torchrun started (this run)", fontsize=14)
    ax.tick_params(axis="x", labelsize=12)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def losses_figure(curves: dict[str, tuple[list[int], list[float], str]]):
    """Training loss against step, one line per run: name -> (steps, losses, style),
    the first drawn wide and pale (the reference the others must lie on)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for n, (name, (steps, losses, style)) in enumerate(curves.items()):
        if n == 0:
            ax.plot(steps, losses, lw=6, alpha=0.3, label=name)
        else:
            ax.plot(steps, losses, style, ms=4, label=name)
    ax.set_xlabel("step", fontsize=14)
    ax.set_ylabel("training loss", fontsize=14)
    ax.legend(fontsize=13)
    fig.tight_layout()
    return fig
