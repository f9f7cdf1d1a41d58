"""The hang-diagnosis path, as data: what a failing job shows, what it means, and the
tool that finds the cause. The debugging page draws its key figure from ``TRIAGE``
(``triage_figure``) and prints its checklist from the same list (``checklist``), so
the two cannot disagree. ``exit_sequence_figure`` draws the exit-order deadlock from
the events of a real run.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch


@dataclass(frozen=True)
class Branch:
    """One symptom class: what you see, what it means, the tool, the checklist step."""

    seen: str  # what the ranks report (short: it is drawn)
    means: str
    tool: str
    step: str  # the checklist's line (Markdown)


# --- begin triage ---
TRIAGE = [
    Branch(
        "Connection\nclosed / reset\nby peer",
        "a rank's\nprocess ended",
        "its log; exit\n-9: dmesg (OOM)",
        "Read every rank's log (`torchrun --log-dir DIR --tee 3`), not just the"
        " first error: the first one reported can be a victim. Exit code -9 is"
        " SIGKILL: look for the out-of-memory killer in `dmesg`.",
    ),
    Branch(
        "Timed out\nwaiting, or a\nsilent hang",
        "a rank did\nnot come (yet)",
        "monitored_\nbarrier, py-spy,\nflight recorder",
        "Name the missing rank with `dist.monitored_barrier` on a gloo group;"
        " dump every rank's stack (`py-spy dump --pid PID`, or `kill -USR1` with"
        " `faulthandler`): the rank that is not in the collective is the cause;"
        " rerun with the flight recorder (`TORCH_FR_BUFFER_SIZE`,"
        " `TORCH_NCCL_DUMP_ON_TIMEOUT=1`) and `torchfrtrace`.",
    ),
    Branch(
        "SIGABRT: data\nsize doesn't\nmatch",
        "the ranks'\nshapes differ",
        "TORCH_DISTRI-\nBUTED_DEBUG\n=DETAIL",
        "Rerun with `TORCH_DISTRIBUTED_DEBUG=DETAIL` (set before torch is imported,"
        " or call `dist.set_debug_level_from_env()` before `init_process_group`):"
        " a mismatch fails at once, naming both shapes.",
    ),
    Branch(
        "no error, but\nwrong or NaN\nnumbers",
        "calls paired\nwrongly, or a\nrank diverged",
        "Lockstep,\ncheck_replicas,\nisfinite/rank",
        "If nothing fails but the numbers are wrong: compare call sites"
        " (`Lockstep`) and replica checksums (`check_replicas`); check each rank's"
        " loss and gradients for NaN before they are reduced, then"
        " `torch.autograd.detect_anomaly()` on the rank that made it.",
    ),
    Branch(
        "training done,\na rank never\nexits",
        "exit-order\ndeadlock",
        "py-spy dump\n--native",
        "If one rank never exits after the last step, dump its native stacks"
        " (`py-spy dump --native`): a main thread in the group's destructor means"
        " the model was freed after `destroy_process_group()`.",
    ),
]
# --- end triage ---

FIRST_STEP = (
    "Make it fail instead of hang: pass `timeout=timedelta(seconds=...)` to"
    " `init_process_group`, a few times the longest legitimate gap between collectives."
)


def checklist(branches=TRIAGE) -> str:
    """The page's checklist, as Markdown: the timeout first, then one step a branch."""
    steps = [FIRST_STEP] + [b.step for b in branches]
    return "\n".join(f"{i}. {step}" for i, step in enumerate(steps, 1))


def _box(ax, x, y, text, color, width=1.85, height=0.86, size=13):
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - height / 2),
            width,
            height,
            boxstyle="round,pad=0.05",
            facecolor=color,
            edgecolor="0.3",
        )
    )
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def triage_figure(branches=TRIAGE):
    """Three columns, one row a branch: what you see -> what it means -> the tool."""
    n = len(branches)
    fig, ax = plt.subplots(figsize=(6.3, 1.2 * n + 0.6))
    columns = [(0, "what you see", "#fde2e1"), (2.2, "means", "#eeeeee")]
    columns.append((4.4, "the tool", "#dff0d8"))
    for x, title, _ in columns:
        ax.text(x, n - 0.25, title, ha="center", fontsize=15, weight="bold")
    for row, branch in enumerate(branches):
        y = n - 1 - row
        texts = (branch.seen, branch.means, branch.tool)
        for (x, _, color), text in zip(columns, texts):
            _box(ax, x, y * 1.0 + 0.1, text, color)
        for x0 in (0, 2.2):
            ax.annotate(
                "",
                (x0 + 1.28, y + 0.1),
                (x0 + 0.92, y + 0.1),
                arrowprops={"arrowstyle": "-|>", "color": "0.3", "lw": 2},
            )
    ax.set_xlim(-1.02, 5.42)
    ax.set_ylim(-0.45, n)
    ax.axis("off")
    fig.tight_layout()
    return fig


# --- begin exit sequence ---
def _bar(ax, lane, left, width, label, color, span, alpha=0.6):
    """A bar with its label inside, or just after it when the bar is short."""
    ax.barh(lane, width, left=left, color=color, alpha=alpha)
    inside = width > 0.3 * span
    x = left + width / 2 if inside else left + width + 0.02 * span
    ha = "center" if inside else "left"
    ax.text(x, lane, label, ha=ha, va="center", fontsize=13)


def exit_sequence_figure(runs: dict) -> plt.Figure:
    """One panel a run of the exit-order demo: rank 0's two threads, the Python probe
    thread and rank 1, on one clock (seconds from the start of rank 0's teardown).

    ``runs`` maps a title to the events of one run: ``start``, ``arrived`` (rank 1
    joins the all-reduce), ``end`` (the teardown returned) or ``killed`` (we saw the
    deadlock and killed rank 0), and ``ticks`` (when the probe thread ran: only
    while nobody holds the GIL)."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.3 * len(runs)), sharex=True)
    lanes = ["probe thread", "gloo worker", "main thread", "rank 1"]
    span = max(
        run.get("killed", run.get("end")) - run["start"] for run in runs.values()
    )
    for ax, (title, run) in zip(axes, runs.items()):
        t0 = run["start"]
        arrived = run["arrived"] - t0
        hung = "killed" in run
        stop = (run["killed"] if hung else run["end"]) - t0
        ticks = [t - t0 for t in run["ticks"] if t - t0 <= stop]
        ax.plot(ticks, [0] * len(ticks), "|", color="tab:blue", ms=16)
        # the worker runs rank 1's all-reduce until rank 1 joins
        short = hung and arrived < 0.3 * span  # no room after it: the next bar
        _bar(ax, 1, 0, arrived, "" if short else "all-reduce", "0.75", span, alpha=1)
        if hung:
            done = "all-reduce done, waits for GIL" if short else "waits for GIL"
            _bar(ax, 1, arrived, stop - arrived, done, "tab:red", span)
            ax.text(stop / 2, 0, "no tick: the GIL is held", ha="center", fontsize=13)
            ax.plot([stop], [2], "X", color="k", ms=14)
            ax.text(stop, 2.45, "killed", ha="right", fontsize=13)
        main = "destroy: holds the GIL" if hung else "destroy: GIL free"
        _bar(ax, 2, 0, stop, main, "tab:red" if hung else "tab:green", span)
        ax.plot([arrived], [3], "v", color="k", ms=12)
        ax.text(arrived, 3.3, "joins", ha="center", fontsize=13)
        ax.set_yticks(range(4), lanes, fontsize=13)
        ax.set_ylim(-0.6, 3.8)
        ax.set_title(title, fontsize=15, loc="left")
        ax.tick_params(axis="x", labelsize=13)
    axes[-1].set_xlabel("seconds since rank 0 began its teardown", fontsize=13)
    fig.tight_layout()
    return fig


# --- end exit sequence ---
