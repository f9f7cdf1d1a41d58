r"""Run logs: list the runs the labs wrote, one line each, and plot their metrics side
by side.

    # every run under runs/
    python -m distlab.tools.runs list
    python -m distlab.tools.runs summary runs/lab2 runs/lab4
    python -m distlab.tools.runs plot runs/lab2 runs/lab4 --metric loss val_loss \
        --out curves.png

A run is a folder with the ``metrics.jsonl`` every lab writes (one line per step: loss,
lr, grad_norm, tokens_per_s, step_s, and val_loss on evaluation steps) and, once it
finished, ``summary.json``. A run that is still going, or died, has no summary; it is
listed with the steps it logged. Notebooks call the same functions: ``find_runs``,
``summarise``, ``plot_runs``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distlab.metrics import read_metrics, read_summary

METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_s")


def find_runs(root: str | Path = "runs") -> list[Path]:
    """Folders under ``root`` (itself included) that hold a metrics.jsonl,
    oldest first."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no folder {root}")
    return sorted(
        (p.parent for p in root.rglob("metrics.jsonl")),
        key=lambda p: (p / "metrics.jsonl").stat().st_mtime,
    )


def _check_run(run: str | Path) -> Path:
    run = Path(run)
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run} is not a run folder (it has no metrics.jsonl)")
    return run


def summarise(run: str | Path) -> dict:
    """One run in a few fields, from its summary.json, or from its metrics if it
    has none."""
    run = _check_run(run)
    lines = read_metrics(run)
    summary = read_summary(run) if (run / "summary.json").is_file() else {}
    vals = [m["val_loss"] for m in lines if "val_loss" in m]
    return {
        "run": str(run),
        "finished": bool(summary),
        "lab": summary.get("lab", "?"),
        "strategy": summary.get("strategy", "?"),
        "ranks": summary.get("world_size"),
        "steps_logged": len(lines),
        "steps": summary.get("steps"),
        "loss": lines[-1]["loss"] if lines else None,
        "val_loss": summary.get("final_val_loss", vals[-1] if vals else None),
        "tokens_per_s": summary.get("tokens_per_s"),
        "mfu": summary.get("mfu"),
        "state_mb_per_rank": (
            summary["state_bytes_per_rank"].get("total", 0) / 1e6
            if summary.get("state_bytes_per_rank")
            else None
        ),
    }


def summary_line(s: dict) -> str:
    """A summary as one line of text."""

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    status = (
        "" if s["finished"] else f"  (unfinished: {s['steps_logged']} steps logged)"
    )
    return (
        f"{s['run']}: {s['lab']} {s['strategy']}, {num(s['ranks'], 'd')} rank(s), "
        f"{s['steps_logged']} steps, loss {num(s['loss'], '.4f')}, val "
        f"{num(s['val_loss'], '.4f')}, "
        f"{num(s['tokens_per_s'], ',.0f')} tokens/s, MFU {num(s['mfu'], '.2f')}, "
        f"state {num(s['state_mb_per_rank'], '.1f')} MB/rank{status}"
    )


def plot_runs(
    runs: list[str | Path],
    metrics=("loss",),
    labels: list[str] | None = None,
    axes=None,
):
    """Each metric in its own panel, one line per run, against the step; returns
    the figure."""
    import matplotlib.pyplot as plt

    runs = [_check_run(r) for r in runs]
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(
            f"unknown metric {unknown[0]!r}; the labs log {', '.join(METRICS)}"
        )
    labels = labels or [str(r) for r in runs]
    if axes is None:
        fig, axes = plt.subplots(
            1, len(metrics), figsize=(4.5 * len(metrics), 3.2), squeeze=False
        )
        axes = axes[0]
    fig = axes[0].figure
    for run, label in zip(runs, labels):
        lines = read_metrics(run)
        for ax, metric in zip(axes, metrics):
            points = [(m["step"], m[metric]) for m in lines if metric in m]
            if points:
                steps, values = zip(*points)
                ax.plot(
                    steps,
                    values,
                    marker="o" if len(points) < 12 else None,
                    ms=3,
                    label=label,
                )
    for ax, metric in zip(axes, metrics):
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.tools.runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser(
        "list", help="every run under a folder, one line each"
    )
    listing.add_argument(
        "root", nargs="?", default="runs", help="folder to search (default: runs)"
    )
    summary = commands.add_parser("summary", help="the given runs, one line each")
    summary.add_argument("runs", nargs="+", help="run folders (with a metrics.jsonl)")
    summary.add_argument(
        "--json", action="store_true", help="the fields as JSON lines instead"
    )
    plot = commands.add_parser(
        "plot", help="metrics of several runs side by side, to an image"
    )
    plot.add_argument("runs", nargs="+", help="run folders (with a metrics.jsonl)")
    plot.add_argument(
        "--metric",
        nargs="+",
        default=["loss"],
        choices=METRICS,
        help="what to plot, a panel each (default: loss)",
    )
    plot.add_argument(
        "--out", default="runs.png", help="image file to write (default: runs.png)"
    )
    args = parser.parse_args(argv)

    try:
        if args.command == "list":
            found = find_runs(args.root)
            for run in found:
                print(summary_line(summarise(run)))
            if not found:
                print(
                    f"no runs under {args.root} (a run is a folder with a "
                    "metrics.jsonl)"
                )
        elif args.command == "summary":
            for run in args.runs:
                s = summarise(run)
                print(json.dumps(s) if args.json else summary_line(s))
        else:
            import matplotlib

            matplotlib.use("Agg")  # to a file: no display needed
            plot_runs(args.runs, args.metric).savefig(args.out, dpi=120)
            print(f"written: {args.out}")
    except (FileNotFoundError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
