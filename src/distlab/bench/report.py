"""What a recorded benchmark (``python -m distlab.bench``) says about the project's goals.

The harness's last lines and the Benchmarks chapter both read the goals through ``targets``,
so a verdict in the book is computed one way only. The chapter's own tables and figures
(scaling, loss agreement, memory) are in ``distlab.chapters.benchmarks``, as are ``run`` and
``activations``, which read one run of a result for both.

    result = load_result("results/bench/cpu_shakespeare_fp32.json")
    targets(result)       # each goal of the project: measured value, met or not
"""

from __future__ import annotations

import json
from pathlib import Path

from distlab.chapters.benchmarks import activations, run
from distlab.infra.paths import REPO_ROOT

RESULTS = REPO_ROOT / "results" / "bench"


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def recorded_results(folder: str | Path = RESULTS) -> dict[str, dict]:
    """Every result file in ``folder``, by file name (without .json)."""
    return {p.stem: load_result(p) for p in sorted(Path(folder).glob("*.json"))}


# (name, what is compared, goal, direction, how it is computed from the runs)
_GOALS = [
    (
        "lab 1 MFU",
        "lab 1, fp32, 1 process: MFU of the measured matmul peak",
        0.80,
        ">=",
        lambda R: R("lab1_single", 1)["mfu"],
    ),
    (
        "DDP vs lab 1",
        "tokens/s: lab 2 on 2 ranks / lab 1 on 1",
        0.90,
        ">=",
        lambda R: R("lab2_ddp", 2)["tokens_per_s"] / R("lab1_single", 1)["tokens_per_s"],
    ),
    (
        "FSDP2 vs DDP",
        "tokens/s: lab 4 / lab 3 (same micro-batches), 2 ranks",
        0.90,
        ">=",
        lambda R: R("lab4_fsdp2", 2)["tokens_per_s"] / R("lab3_grad_accum", 2)["tokens_per_s"],
    ),
    (
        "FSDP2 state",
        "model state bytes per rank: lab 4 / lab 3, 2 ranks",
        0.52,
        "<=",
        lambda R: (
            R("lab4_fsdp2", 2)["state_bytes_per_rank"]["total"]
            / R("lab3_grad_accum", 2)["state_bytes_per_rank"]["total"]
        ),
    ),
    (
        "full AC time",
        "step time: lab 5 (full AC) / lab 4, 2 ranks",
        1.35,
        "<=",
        lambda R: R("lab5_activation_ckpt", 2)["step_s"] / R("lab4_fsdp2", 2)["step_s"],
    ),
    (
        "full AC activations",
        "activation bytes at the peak: lab 5 / lab 4, 2 ranks",
        0.20,
        "<=",
        lambda R: activations(R("lab5_activation_ckpt", 2)) / activations(R("lab4_fsdp2", 2)),
    ),
]


def targets(result: dict) -> list[dict]:
    """Each goal with its measured value; ``met`` is None where the runs it needs are missing."""

    def R(lab: str, n: int) -> dict:  # noqa: N802 - reads like the table
        found = run(result, lab, n)
        if found is None:
            raise LookupError(f"{lab} at {n} rank(s)")
        return found

    rows = []
    for name, compared, goal, direction, compute in _GOALS:
        missing = "an MFU: it came out above 1 and was not recorded"  # the one figure a run may leave None
        try:
            value = compute(R)
        except LookupError as err:
            value, missing = None, str(err)
        if value is None:
            rows.append(
                {
                    "goal": name,
                    "compared": compared,
                    "target": f"{direction} {goal}",
                    "measured": None,
                    "met": None,
                    "missing": missing,
                }
            )
            continue
        met = value >= goal if direction == ">=" else value <= goal
        rows.append(
            {"goal": name, "compared": compared, "target": f"{direction} {goal}", "measured": value, "met": met}
        )
    return rows


def print_targets(result: dict) -> None:
    print("\ngoal                  target   measured")
    for row in targets(result):
        if row["met"] is None:
            print(f"{row['goal']:21} {row['target']:>8}   not measured (no {row['missing']})")
        else:
            print(f"{row['goal']:21} {row['target']:>8}   {row['measured']:.3f}  {'met' if row['met'] else 'MISSED'}")
