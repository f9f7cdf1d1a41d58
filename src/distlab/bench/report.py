"""What a recorded benchmark (``python -m distlab.bench``) says: ratios, scaling, goals.

The Benchmarks chapter, the harness's last lines and the tests all read results through
these functions, so a figure in the book is computed one way only.

    result = load_result("results/bench/cpu_shakespeare_fp32.json")
    run(result, "lab4_fsdp2", 2)["tokens_per_s"]
    targets(result)       # each goal of the project: measured value, met or not
    scaling(result)       # tokens/s at N ranks over N times the same lab at 1 rank
"""

from __future__ import annotations

import json
from pathlib import Path

from distlab.infra.paths import REPO_ROOT

RESULTS = REPO_ROOT / "results" / "bench"


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def recorded_results(folder: str | Path = RESULTS) -> dict[str, dict]:
    """Every result file in ``folder``, by file name (without .json)."""
    return {p.stem: load_result(p) for p in sorted(Path(folder).glob("*.json"))}


def run(result: dict, lab: str, world_size: int) -> dict | None:
    """The run of ``lab`` at ``world_size`` ranks, or None if it was not made or failed."""
    for r in result["runs"]:
        if r["lab"] == lab and r["world_size"] == world_size and "error" not in r:
            return r
    return None


def activations(r: dict) -> int:
    """Activation bytes in rank 0's peak moment (the tracker's "activations" kind)."""
    return r["peak_bytes_by_kind"]["activations"]


# (name, what is compared, goal, direction, how it is computed from the runs)
_GOALS = [
    (
        "lab 1 MFU",
        "lab 1, fp32, 1 process: achieved FLOP/s / measured matmul peak",
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
        try:
            value = compute(R)
        except LookupError as missing:
            rows.append(
                {
                    "goal": name,
                    "compared": compared,
                    "target": f"{direction} {goal}",
                    "measured": None,
                    "met": None,
                    "missing": str(missing),
                }
            )
            continue
        met = value >= goal if direction == ">=" else value <= goal
        rows.append(
            {"goal": name, "compared": compared, "target": f"{direction} {goal}", "measured": value, "met": met}
        )
    return rows


def scaling(result: dict) -> list[dict]:
    """Per lab and rank count: tokens/s, and the efficiency against the same lab on 1 rank
    (and against lab 1) = tokens/s at N / (N x tokens/s at 1)."""
    lab1 = run(result, "lab1_single", 1)
    rows = []
    for r in result["runs"]:
        if "error" in r:
            continue
        one = run(result, r["lab"], 1)
        n = r["world_size"]
        rows.append(
            {
                "lab": r["lab"],
                "ranks": n,
                "tokens_per_s": r["tokens_per_s"],
                "efficiency_vs_own_1_rank": r["tokens_per_s"] / (n * one["tokens_per_s"]) if one else None,
                "efficiency_vs_lab1": r["tokens_per_s"] / (n * lab1["tokens_per_s"]) if lab1 else None,
            }
        )
    return rows


def loss_agreement(result: dict) -> dict[tuple[str, int], float]:
    """Largest relative difference of each run's losses from lab 1's, step by step."""
    lab1 = run(result, "lab1_single", 1)
    if lab1 is None:
        return {}
    return {
        (r["lab"], r["world_size"]): max(abs(a - b) / abs(b) for a, b in zip(r["losses"], lab1["losses"]))
        for r in result["runs"]
        if "error" not in r
    }


def print_targets(result: dict) -> None:
    print("\ngoal                  target   measured")
    for row in targets(result):
        if row["met"] is None:
            print(f"{row['goal']:21} {row['target']:>8}   not measured (no {row['missing']})")
        else:
            print(f"{row['goal']:21} {row['target']:>8}   {row['measured']:.3f}  {'met' if row['met'] else 'MISSED'}")
