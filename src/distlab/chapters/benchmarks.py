"""The Benchmarks chapter: what a recorded ``python -m distlab.bench`` result says, as
the page's tables and figures, plus the two short runs its run-logs section lists
and plots.

    result = recorded_results()["cpu_shakespeare_fp32"]   # distlab.bench.report
    run(result, "lab4_fsdp2", 2)["tokens_per_s"]
    loss_agreement(result)    # every run's losses against lab 1's, step by step
    scaling(result)           # tokens/s at N ranks over N times the same lab at 1 rank

The page never reruns the benchmark: everything here reads the recorded result. ``run``
and ``activations`` are also what the harness's own report (``distlab.bench.report``)
reads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from distlab.infra.launch import run_script

MB = 1e6
# the labs in the order the book builds them, with the names the tables show
LAB_NAMES = {
    "lab1_single": "1 single",
    "lab2_ddp": "2 DDP",
    "lab3_grad_accum": "3 DDP + accumulation",
    "lab4_fsdp2": "4 FSDP2",
    "lab5_activation_ckpt": "5 FSDP2 + full AC",
    "lab6_accelerate": "6 Accelerate (DDP + full AC)",
}
# the memory tracker's kinds of bytes, in a few groups (one colour each)
MEMORY_GROUPS = {
    "parameters": ("params", "sharded_params", "unsharded_params", "buffers"),
    "gradients": ("grads", "sharded_grads", "unsharded_grads"),
    "optimizer state": ("optimizer",),
    "activations": ("activations",),
    "temporaries and collectives": (
        "temporaries",
        "all_gather",
        "reduce_scatter",
        "inputs",
        "other",
    ),
}


def run(result: dict, lab: str, world_size: int) -> dict | None:
    """The run of ``lab`` at ``world_size`` ranks, or None if it was not made
    or failed."""
    for r in result["runs"]:
        if r["lab"] == lab and r["world_size"] == world_size and "error" not in r:
            return r
    return None


def activations(r: dict) -> int:
    """Activation bytes in rank 0's peak moment (the tracker's "activations" kind)."""
    return r["peak_bytes_by_kind"]["activations"]


def scaling(result: dict) -> list[dict]:
    """Per lab and rank count: tokens/s, and the efficiency against the same lab on 1
    rank (and against lab 1) = tokens/s at N / (N x tokens/s at 1)."""
    lab1 = run(result, "lab1_single", 1)
    rows = []
    for r in result["runs"]:
        if "error" in r:
            continue
        one, n = run(result, r["lab"], 1), r["world_size"]
        rows.append(
            {
                "lab": r["lab"],
                "ranks": n,
                "tokens_per_s": r["tokens_per_s"],
                "efficiency_vs_own_1_rank": r["tokens_per_s"]
                / (n * one["tokens_per_s"])
                if one
                else None,
                "efficiency_vs_lab1": r["tokens_per_s"] / (n * lab1["tokens_per_s"])
                if lab1
                else None,
            }
        )
    return rows


def loss_agreement(result: dict) -> dict[tuple[str, int], float]:
    """Largest relative difference of each run's losses from lab 1's, step by step."""
    lab1 = run(result, "lab1_single", 1)
    if lab1 is None:
        return {}
    return {
        (r["lab"], r["world_size"]): max(
            abs(a - b) / abs(b) for a, b in zip(r["losses"], lab1["losses"])
        )
        for r in result["runs"]
        if "error" not in r
    }


def threads_per_rank(r: dict) -> int:
    """The intra-op threads each rank of a recorded run had (its peak was timed
    with them)."""
    return r["peak_measured_with"]["threads_per_rank"]


def mark(n: int, cores: int) -> str:
    """A rank count, starred when the ranks outnumber the cores (they then
    share them)."""
    return f"{n}*" if n > cores else str(n)


def runs_table(result: dict) -> list[dict]:
    """One row per recorded run: speed, memory and final losses, formatted for
    the page."""
    cores, rows = result["provenance"]["cpu_count"], []
    for r in result["runs"]:
        row = {"lab": LAB_NAMES[r["lab"]], "ranks": mark(r["world_size"], cores)}
        if "error" in r:
            rows.append({**row, "tokens/s": "failed: " + r["error"]})
            continue
        repeats = r.get("tokens_per_s_repeats", [r["tokens_per_s"]])
        rows.append(
            {
                **row,
                "tokens/s": f"{r['tokens_per_s']:,.0f}",
                "all repeats": ", ".join(f"{t:,.0f}" for t in repeats),
                "step (s)": f"{r['step_s']:.2f}",
                # of the measured matmul peak
                "MFU": "-" if r["mfu"] is None else f"{r['mfu']:.2f}",
                "state MB/rank": f"{r['state_bytes_per_rank']['total'] / MB:.1f}",
                "peak MB (rank 0)": f"{r['peak_bytes_by_kind']['total'] / MB:.1f}",
                "train loss": f"{r['final_train_loss']:.4f}",
                "val loss": f"{r['final_val_loss']:.4f}",
            }
        )
    return rows


def repeat_spread(result: dict) -> float:
    """The largest (fastest / slowest - 1) over the repeats of one lab at one
    rank count."""
    runs = [r["tokens_per_s_repeats"] for r in result["runs"] if "error" not in r]
    return max(max(t) / min(t) - 1 for t in runs)


def efficiency_table(result: dict) -> list[dict]:
    """``scaling`` formatted for the page, lab 1 left out (it ran on one
    process only)."""
    cores = result["provenance"]["cpu_count"]

    def fmt(x):
        return "-" if x is None else f"{x:.2f}"

    return [
        {
            "lab": LAB_NAMES[row["lab"]],
            "ranks": mark(row["ranks"], cores),
            "tokens/s": f"{row['tokens_per_s']:,.0f}",
            "vs the same lab on 1 rank": fmt(row["efficiency_vs_own_1_rank"]),
            "vs lab 1": fmt(row["efficiency_vs_lab1"]),
        }
        for row in scaling(result)
        if row["lab"] != "lab1_single"
    ]


def ac_tradeoff_table(result: dict, ranks=(1, 2, 4)) -> list[dict]:
    """Lab 5 (full activation checkpointing) against lab 4 at each rank count: step time
    and the activation bytes at rank 0's peak."""
    rows, cores = [], result["provenance"]["cpu_count"]
    for n in ranks:
        with_ac, without = (
            run(result, "lab5_activation_ckpt", n),
            run(result, "lab4_fsdp2", n),
        )
        if not (with_ac and without):
            continue
        rows.append(
            {
                "ranks": mark(n, cores),
                "step (s), lab 4": f"{without['step_s']:.2f}",
                "step (s), lab 5": f"{with_ac['step_s']:.2f}",
                "time, lab 5 / lab 4": f"{with_ac['step_s'] / without['step_s']:.2f}",
                "activations MB, lab 4": f"{activations(without) / MB:.1f}",
                "activations MB, lab 5": f"{activations(with_ac) / MB:.1f}",
                "activations, lab 5 / lab 4": (
                    f"{activations(with_ac) / activations(without):.2f}"
                ),
            }
        )
    return rows


def goal_table(goal_rows: list[dict]) -> list[dict]:
    """``distlab.bench.report.targets`` rows formatted for the page: the measured
    value, the range the repeats allow, and the verdict (met, missed, within noise)."""
    return [
        {
            "goal": row["goal"],
            "target": row["target"],
            "measured": "-" if row["measured"] is None else f"{row['measured']:.2f}",
            "range": "-"
            if row.get("low") is None
            else f"{row['low']:.2f}-{row['high']:.2f}",
            "verdict": row.get("verdict", "not measured"),
        }
        for row in goal_rows
    ]


def scaling_figure(result: dict):
    """Tokens/s against ranks for each lab, and the same over ranks x lab 1's; shaded
    where the ranks outnumber the cores."""
    import matplotlib.pyplot as plt

    cores, lab1 = result["provenance"]["cpu_count"], run(result, "lab1_single", 1)
    fig, (ax, ax_eff) = plt.subplots(1, 2, figsize=(10, 3.6))
    for lab, name in LAB_NAMES.items():
        points = sorted(
            (r["world_size"], r["tokens_per_s"])
            for r in result["runs"]
            if r["lab"] == lab and "error" not in r
        )
        if len(points) > 1:
            ax.plot(*zip(*points), marker="o", label=name)
            ax_eff.plot(
                [n for n, _ in points],
                [t / (n * lab1["tokens_per_s"]) for n, t in points],
                marker="o",
                label=name,
            )
    ax.axhline(
        lab1["tokens_per_s"], color="gray", ls="--", lw=1, label="1 single (1 process)"
    )
    for a in (ax, ax_eff):
        a.axvspan(cores + 0.5, 4.5, color="red", alpha=0.06)
        a.set_xticks([1, 2, 4])
        a.set_xlabel(f"ranks (shaded: more ranks than the {cores} cores)")
    ax.set_ylabel("tokens/s")
    ax_eff.set_ylabel("tokens/s / (ranks x lab 1's)")
    ax_eff.axhline(1.0, color="gray", ls=":", lw=1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def memory_figure(result: dict, ranks=(1, 2, 4)):
    """Rank 0's bytes at its peak, by group of kinds, for every lab at each
    rank count."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ranks), figsize=(13, 3.8), sharey=True)
    for ax, n in zip(axes, ranks):
        labs = [lab for lab in LAB_NAMES if run(result, lab, n)]
        bottom = [0.0] * len(labs)
        for group, kinds in MEMORY_GROUPS.items():
            heights = [
                sum(run(result, lab, n)["peak_bytes_by_kind"].get(k, 0) for k in kinds)
                / MB
                for lab in labs
            ]
            ax.bar(range(len(labs)), heights, bottom=bottom, label=group)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(
            range(len(labs)),
            [LAB_NAMES[lab] for lab in labs],
            rotation=30,
            ha="right",
            fontsize=8,
        )
        ax.set_title(f"{n} rank(s): rank 0 at its peak", fontsize=10)
    axes[0].set_ylabel("MB")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def two_short_runs(out: str | Path, steps: int = 30) -> list[Path]:
    """Lab 1 on one process and lab 4 on 2 ranks, tiny model: two run folders to list
    and plot."""
    common = [
        "--preset",
        "tiny",
        "--steps",
        str(steps),
        "--batch-size",
        "16",
        "--eval-every",
        "10",
    ]
    common += ["--eval-batches", "2", "--sample-chars", "0", "--no-progress"]
    folders = [Path(out) / "lab1", Path(out) / "lab4"]
    run_script("src/labs/lab1_single.py", [*common, "--out", folders[0]], quiet=True)
    run_script(
        "src/labs/lab4_fsdp2.py", [*common, "--out", folders[1]], nprocs=2, quiet=True
    )
    return folders


def runs_cli(*args: str) -> str:
    """What ``python -m distlab.tools.runs ARGS`` prints (it fails loudly if the
    command does)."""
    command = [sys.executable, "-m", "distlab.tools.runs", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout
