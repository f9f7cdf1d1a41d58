"""Benchmark lab 1: tokens/s and MFU, per dtype, on the machine it runs on.

    python -m distlab.bench --preset shakespeare --batch-size 16 --steps 30 --dtypes fp32 bf16

Each dtype is a real run of ``src/labs/lab1_single.py``; the figures are read from the
``summary.json`` it writes (the first two steps are left out of tokens/s), and the
results are written together to ``--out/bench.json`` with where they were measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from distlab.flops import device_name
from distlab.launch import REPO_ROOT, run_script
from distlab.metrics import read_summary
from distlab.runtime import pick_device


def _commit() -> str:
    """The commit measured; "+dirty" when tracked files had uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(result: dict, path: str | Path) -> Path:
    """Write a benchmark's result (with its provenance) as indented JSON, and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {path}")
    return path


def provenance(module: str, argv: list[str] | None) -> dict:
    """Where and when a measurement was made, and the command that made it."""
    command = " ".join(sys.argv[1:] if argv is None else map(str, argv))
    return {
        "machine": device_name(pick_device("auto")), "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "torch": torch.__version__, "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"python -m {module} {command}".strip(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare", help="model preset (default: shakespeare)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (default: 16)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run, first 2 untimed (default: 30)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], help="dtypes to run (default: fp32 bf16)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    parser.add_argument("--out", default="runs/bench", help="directory for runs and bench.json")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first two steps are not timed)")

    out = Path(args.out)
    runs = {}
    for dtype in args.dtypes:
        run_dir = out / f"lab1_{args.preset}_{dtype}"
        print(f"== lab 1, {args.preset}, batch {args.batch_size}, {args.steps} steps, {dtype}", flush=True)
        run_script("src/labs/lab1_single.py",
                   ["--preset", args.preset, "--batch-size", args.batch_size, "--steps", args.steps,
                    "--dtype", dtype, "--device", args.device, "--eval-batches", 1,
                    "--sample-chars", 0, "--out", run_dir], timeout=args.timeout)
        runs[dtype] = read_summary(run_dir)

    result = {
        "provenance": provenance("distlab.bench", argv),
        "runs": {dtype: {k: s[k] for k in ("preset", "dtype", "device", "global_batch", "steps", "tokens_per_s",
                                           "achieved_flops_per_s", "peak_flops_per_s", "mfu", "final_train_loss")}
                 for dtype, s in runs.items()},
    }
    print(f"\n{'dtype':6} {'tokens/s':>10} {'step s':>8} {'GFLOP/s':>9} {'peak':>8} {'MFU':>6}")
    for dtype, s in result["runs"].items():
        step_s = runs[dtype]["tokens_per_step"] / s["tokens_per_s"]
        print(f"{dtype:6} {s['tokens_per_s']:10,.0f} {step_s:8.2f} {s['achieved_flops_per_s'] / 1e9:9.1f} "
              f"{s['peak_flops_per_s'] / 1e9:8.1f} {s['mfu']:6.2f}")
    if {"fp32", "bf16"} <= runs.keys():
        ratio = runs["bf16"]["tokens_per_s"] / runs["fp32"]["tokens_per_s"]
        result["bf16_over_fp32_tokens_per_s"] = ratio
        print(f"bf16 / fp32 tokens/s: {ratio:.2f}x")
        if runs["bf16"]["peak_flops_per_s"] < runs["fp32"]["peak_flops_per_s"]:
            print("note: this device's bf16 matmul peak is below its fp32 peak: it has no native bf16 "
                  "arithmetic (on CPUs: no AVX512-BF16 or AMX), so bf16 cannot be faster here")
    write_result(result, out / "bench.json")
    return result


if __name__ == "__main__":
    main()
