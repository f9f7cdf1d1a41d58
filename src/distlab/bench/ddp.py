"""Benchmark data parallelism: lab 2 against lab 1, and DDP built from scratch against torch's.

    python -m distlab.bench.ddp --preset shakespeare --batch-size 16 --steps 12 --nprocs 2

Measures, on the machine it runs on:
* lab 1 (one process, all cores) and lab 2 (N ranks, cores shared out) as a user runs them;
* torch DDP (``ddp``) and the from-scratch ``ddp-naive``, ``ddp-hooks``, ``ddp-bucketed`` on the
  same workload (strategy names from ``distlab.infra.experiment``);
* torch DDP at several ``bucket_cap_mb``.
Results go to ``--out`` (default ``results/ddp_bench.json``) with their provenance; the
DDP chapter reads that file instead of re-running minutes of benchmarks at every build.
"""

from __future__ import annotations

import argparse
import tempfile

from distlab.bench.provenance import provenance, write_result
from distlab.chapters.ddp_internals import FROM_SCRATCH, train_steps
from distlab.infra.experiment import WARMUP_STEPS
from distlab.infra.launch import run_ranks, run_script
from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_summary


def lab_tokens_per_s(script: str, nprocs: int, preset: str, batch: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        run_script(
            f"src/labs/{script}",
            [
                "--preset",
                preset,
                "--batch-size",
                batch,
                "--steps",
                steps,
                "--eval-batches",
                1,
                "--sample-chars",
                0,
                "--no-progress",
                "--out",
                out,
            ],
            nprocs=nprocs,
            timeout=1800,
            quiet=True,
        )
        s = read_summary(out)
    return {"tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"], "world_size": s["world_size"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--steps", type=int, default=12, help=f"steps per run; the first {WARMUP_STEPS} are not timed")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks")
    parser.add_argument("--bucket-caps", type=float, nargs="+", default=[1.0, 25.0, 100.0])
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "ddp_bench.json"))
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} untimed warm-up steps")

    result = {
        "provenance": provenance("distlab.bench.ddp", argv),
        "workload": {
            "preset": args.preset,
            "global_batch": args.batch_size,
            "steps": args.steps,
            "nprocs": args.nprocs,
        },
    }
    print(f"labs ({args.preset}, batch {args.batch_size}, {args.steps} steps)", flush=True)
    result["labs"] = {
        "lab1_single (1 process)": lab_tokens_per_s("lab1_single.py", 1, args.preset, args.batch_size, args.steps),
        f"lab2_ddp ({args.nprocs} ranks)": lab_tokens_per_s(
            "lab2_ddp.py", args.nprocs, args.preset, args.batch_size, args.steps
        ),
    }
    for name, r in result["labs"].items():
        print(f"  {name:26} {r['tokens_per_s']:9,.0f} tokens/s", flush=True)

    def run(strategy: str, cap: float = 25.0) -> dict:
        ranks = run_ranks(
            train_steps,
            nprocs=args.nprocs,
            timeout=1800,
            quiet=True,
            args=(strategy, args.preset, args.steps, args.batch_size, 1337, cap),
        )
        return {"tokens_per_s": min(r["tokens_per_s"] for r in ranks), "bucket_cap_mb": cap}

    result["wrappers"] = {}
    for strategy in ("ddp", *FROM_SCRATCH):
        result["wrappers"][strategy] = run(strategy)
        print(f"  {strategy:26} {result['wrappers'][strategy]['tokens_per_s']:9,.0f} tokens/s", flush=True)
    result["bucket_caps"] = {}
    for cap in args.bucket_caps:
        result["bucket_caps"][str(cap)] = run("ddp", cap)
        print(
            f"  torch DDP, bucket_cap_mb={cap:<6} {result['bucket_caps'][str(cap)]['tokens_per_s']:9,.0f} tokens/s",
            flush=True,
        )

    labs = list(result["labs"].values())
    w = result["wrappers"]
    result["ratios"] = {
        "lab2_over_lab1": labs[1]["tokens_per_s"] / labs[0]["tokens_per_s"],
        **{f"{s}_over_ddp": w[s]["tokens_per_s"] / w["ddp"]["tokens_per_s"] for s in FROM_SCRATCH},
    }
    for name, ratio in result["ratios"].items():
        print(f"  {name:26} {ratio:.3f}")
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
