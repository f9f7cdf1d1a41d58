r"""Benchmark data parallelism: lab 2 against lab 1, and DDP built from scratch
against torch's.

    python -m distlab.bench.ddp --preset shakespeare --batch-size 16 --steps 12 \
        --nprocs 2 --repeats 3

Measures, on the machine it runs on, one row per variant:
* ``lab1_single`` (one process, all cores) and ``lab2_ddp`` (N ranks, the cores shared
  out), run as a user runs them, with their MFU of the measured matmul peak;
* torch DDP at its default settings (``ddp``: ``bucket_cap_mb`` not passed, so the first
  bucket is 1 MiB and the others 25 MiB) and the from-scratch ``ddp-naive``,
  ``ddp-hooks`` and ``ddp-bucketed`` at theirs, on the same workload (strategy names
  from ``distlab.infra.experiment``);
* torch DDP with ``bucket_cap_mb`` passed (``ddp cap=X``): every bucket that size, no
  small first one.

Every row runs ``--repeats`` times, round after round over all rows (A B C A B C ...),
so a slow spell of a shared machine falls on every row rather than on one. A row keeps
each repeat's tokens/s, their median and their spread (min to max); ``compare`` calls
two rows different only when their spreads do not overlap. Results go to ``--out``
(default ``results/ddp_bench.json``) with their provenance; the DDP chapter reads that
file (through ``table``, ``verdict`` and ``figure``) instead of re-running
the benchmark.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from distlab.bench.provenance import finished, provenance, write_result
from distlab.chapters.ddp_internals import FROM_SCRATCH
from distlab.infra import claims
from distlab.infra.experiment import WARMUP_STEPS, WrapOptions, train
from distlab.infra.launch import run_ranks, run_script
from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_summary

SCHEMA = 2  # 2: rows with repeats, median and spread; torch DDP at its defaults
LAB_SCRIPTS = {"lab1_single": "lab1_single.py", "lab2_ddp": "lab2_ddp.py"}


def lab_run(script: str, nprocs: int, preset: str, batch: int, steps: int) -> dict:
    """One run of a lab script: its tokens/s and MFU, and the threads each rank had."""
    args = ["--preset", preset, "--batch-size", batch, "--steps", steps]
    args += ["--eval-batches", 1, "--sample-chars", 0, "--no-progress"]
    with tempfile.TemporaryDirectory() as out:
        run_script(
            f"src/labs/{script}",
            [*args, "--out", out],
            nprocs=nprocs,
            timeout=1800,
            quiet=True,
        )
        s = read_summary(out)
    return {
        "tokens_per_s": s["tokens_per_s"],
        "mfu": s["mfu"],  # of the measured matmul peak; None where it came out above 1
        "peak_flops_per_s": s["peak_flops_per_s"],
        "threads_per_rank": s["peak_measured_with"]["threads_per_rank"],
    }


def _train_on_ranks(
    strategy: str, preset: str, steps: int, batch: int, cap: float | None
) -> dict:
    return train(strategy, preset, steps, batch, options=WrapOptions(bucket_cap_mb=cap))


def wrapper_run(
    strategy: str, nprocs: int, preset: str, batch: int, steps: int, cap: float | None
) -> dict:
    """One run of a wrapper through the experiment harness: the slowest
    rank's tokens/s."""
    ranks = run_ranks(
        _train_on_ranks,
        nprocs=nprocs,
        timeout=1800,
        quiet=True,
        args=(strategy, preset, steps, batch, cap),
    )
    return {
        "tokens_per_s": min(r["tokens_per_s"] for r in ranks),
        "threads_per_rank": ranks[0]["threads"],
    }


def plan(nprocs: int, caps: list[float]) -> dict[str, dict]:
    """The rows: what each one is, and how to run it (a lab script, or a strategy with
    a cap)."""
    rows = {
        "lab1_single": {"about": "lab 1, 1 process", "ranks": 1, "lab": "lab1_single"},
        "lab2_ddp": {
            "about": f"lab 2, {nprocs} ranks",
            "ranks": nprocs,
            "lab": "lab2_ddp",
        },
        "ddp": {
            "about": "torch DDP, default settings",
            "ranks": nprocs,
            "strategy": "ddp",
            "cap": None,
        },
    }
    for s in FROM_SCRATCH:
        rows[s] = {
            "about": f"{s} (from scratch), its defaults",
            "ranks": nprocs,
            "strategy": s,
            "cap": None,
        }
    for cap in caps:
        rows[f"ddp cap={cap:g}"] = {
            "about": f"torch DDP, bucket_cap_mb={cap:g} passed",
            "ranks": nprocs,
            "strategy": "ddp",
            "cap": cap,
        }
    return rows


def compare(result: dict, row: str, baseline: str) -> str:
    """``row`` against ``baseline`` by tokens/s: "faster" or "slower" only when their
    spreads (min to max over the repeats) do not overlap; else "within noise"."""
    rows = result["rows"]
    verdict = claims.compare(rows[row]["tokens_per_s"], rows[baseline]["tokens_per_s"])
    return {"larger": "faster", "smaller": "slower"}.get(verdict, verdict)


def verdict(result: dict, row: str) -> str:
    """What ``row`` is compared with (lab 2 with lab 1, every other row with torch DDP
    at its defaults) and how ``compare`` judges it; "" for the baselines themselves."""
    baseline = {"lab1_single": None, "ddp": None, "lab2_ddp": "lab1_single"}.get(
        row, "ddp"
    )
    return (
        "" if baseline is None else f"{compare(result, row, baseline)} (vs {baseline})"
    )


def table(result: dict) -> list[dict]:
    """The rows for a page: median tokens/s, the spread over the repeats, and
    the verdict."""
    ddp = result["rows"]["ddp"]["tokens_per_s"]["median"]
    rows = []
    for name, row in result["rows"].items():
        t = row["tokens_per_s"]
        rows.append(
            {
                "row": name,
                "what": row["about"],
                "tokens/s, median": f"{t['median']:,.0f}",
                "min - max": f"{t['min']:,.0f} - {t['max']:,.0f}",
                "spread": f"{t['max'] / t['min'] - 1:.0%}",
                "median / torch DDP's": f"{t['median'] / ddp:.2f}",
                "verdict": verdict(result, name),
            }
        )
    return rows


def figure(result: dict):
    """Median tokens/s of each row, with the min-max spread of its repeats as an error
    bar: the labs and wrappers on the left, torch DDP with bucket_cap_mb passed on
    the right."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    left = [n for n in rows if not n.startswith("ddp cap=")]
    right = ["ddp", *(n for n in rows if n.startswith("ddp cap="))]
    fig, axes = plt.subplots(
        1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [len(left), len(right)]}
    )
    for ax, names in zip(axes, (left, right)):
        t = [rows[n]["tokens_per_s"] for n in names]
        medians = [x["median"] for x in t]
        errors = [
            [m - x["min"] for m, x in zip(medians, t)],
            [x["max"] - m for m, x in zip(medians, t)],
        ]
        ax.bar(names, medians, yerr=errors, capsize=4, color="#3b6ea5")
        ax.set_ylabel("tokens/s (median; bar: min-max)")
        ax.tick_params(axis="x", rotation=30)
    w = result["workload"]
    axes[0].set_title(
        f"{w['nprocs']} ranks, {w['preset']}, batch {w['global_batch']}, "
        f"{w['repeats']} repeats each"
    )
    axes[1].set_title("torch DDP: default vs bucket_cap_mb passed")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="shakespeare")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument(
        "--steps",
        type=int,
        default=12,
        help=f"steps per run; the first {WARMUP_STEPS} are not timed",
    )
    parser.add_argument("--nprocs", type=int, default=2, help="ranks")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every row, interleaved (at least 3)",
    )
    parser.add_argument(
        "--bucket-caps",
        type=float,
        nargs="*",
        default=[1.0, 25.0, 100.0],
        help="bucket_cap_mb values passed",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "ddp_bench.json"))
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(
            f"--steps must be more than the {WARMUP_STEPS} untimed warm-up steps"
        )
    if args.repeats < 3:
        parser.error(
            "--repeats must be at least 3: a spread needs more than two points"
        )

    # before the first run: the code that runs
    measured = provenance("distlab.bench.ddp", argv)
    rows = plan(args.nprocs, args.bucket_caps)
    made: dict[str, list[dict]] = {name: [] for name in rows}
    for round_ in range(args.repeats):
        for name, row in rows.items():  # A B C, then A B C again: interleaved
            start = time.perf_counter()
            if "lab" in row:
                r = lab_run(
                    LAB_SCRIPTS[row["lab"]],
                    row["ranks"],
                    args.preset,
                    args.batch_size,
                    args.steps,
                )
            else:
                r = wrapper_run(
                    row["strategy"],
                    row["ranks"],
                    args.preset,
                    args.batch_size,
                    args.steps,
                    row["cap"],
                )
            made[name].append(r)
            unrecorded = (
                "  MFU above 1, not recorded: its peak was timed under more load"
                if r.get("mfu", 0) is None
                else ""
            )
            print(
                f"[{round_ + 1}/{args.repeats}] {name:18} "
                f"{r['tokens_per_s']:9,.0f} tokens/s "
                f"({time.perf_counter() - start:.0f} s){unrecorded}",
                flush=True,
            )

    result = {
        "schema": SCHEMA,
        "provenance": finished(measured),
        "workload": {
            "preset": args.preset,
            "global_batch": args.batch_size,
            "steps": args.steps,
            "nprocs": args.nprocs,
            "repeats": args.repeats,
        },
        "rows": {},
    }
    for name, row in rows.items():
        runs = made[name]
        entry = {
            "about": row["about"],
            "ranks": row["ranks"],
            "bucket_cap_mb": row.get("cap"),  # None: not passed, the wrapper's default
            "threads_per_rank": runs[0]["threads_per_rank"],
            "tokens_per_s": claims.spread([r["tokens_per_s"] for r in runs]),
        }
        if "lab" in row:
            # of the measured matmul peak, per repeat
            entry["mfu"] = [r["mfu"] for r in runs]
            entry["peak_flops_per_s"] = [r["peak_flops_per_s"] for r in runs]
        result["rows"][name] = entry
    for name in result["rows"]:
        if verdict(result, name):
            print(f"  {name:18} {verdict(result, name)}")
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
