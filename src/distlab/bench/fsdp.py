"""Benchmark DDP against FSDP2 per rank: bytes of model state, peak memory, tokens/s.

    python -m distlab.bench.fsdp --preset shakespeare --batch-size 16 --steps 6 --nprocs 2 4

For each world size, DDP and FSDP2 (and FSDP2 without resharding after forward) train the
same batches; each run reports the bytes of parameters, gradients and AdamW state one rank
holds (counted from the tensors), the peak bytes PyTorch's memory tracker saw in one step,
tokens/s and the losses. FSDP2 with bf16 compute (``--bf16-steps`` steps, at the first
world size) is measured beside fp32. Results go to ``--out`` (default
``results/fsdp_bench.json``) with their provenance; the FSDP2 chapter reads
``results/fsdp_bench_batch16.json`` and ``results/fsdp_bench_batch64.json``.
"""

from __future__ import annotations

import argparse
import statistics

from distlab.bench.provenance import provenance, write_result
from distlab.chapters.fsdp2 import train
from distlab.infra.experiment import WARMUP_STEPS
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT
from distlab.model import preset as model_preset


def measure(strategy: str, nprocs: int, preset: str, batch: int, steps: int) -> dict:
    ranks = run_ranks(
        train,
        nprocs=nprocs,
        timeout=3600,
        quiet=True,
        pg_timeout=900,
        args=(strategy, preset, steps, batch, 1337, 1e-3, True),
    )  # track_peak
    step_s = [max(s) for s in zip(*(r["step_s"] for r in ranks))]  # a step ends when its slowest rank does
    timed = step_s[WARMUP_STEPS:]
    return {
        "strategy": strategy,
        "world_size": nprocs,
        "losses": ranks[0]["losses"],
        "tokens_per_s": batch * model_preset(preset).block_size / statistics.median(timed),
        "state_per_rank": [r["state_bytes"] for r in ranks],
        "peak_per_rank": [r["peak"] for r in ranks],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="shakespeare")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--steps", type=int, default=6, help=f"steps per run; the first {WARMUP_STEPS} are not timed")
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4], help="world sizes")
    parser.add_argument("--bf16-steps", type=int, default=3, help="steps of the bf16 run (0: skip)")
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "fsdp_bench.json"))
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS or (args.bf16_steps and args.bf16_steps <= WARMUP_STEPS):
        parser.error(f"--steps and --bf16-steps must be more than the {WARMUP_STEPS} untimed warm-up steps")

    result = {
        "provenance": provenance("distlab.bench.fsdp", argv),
        "workload": {"preset": args.preset, "global_batch": args.batch_size, "steps": args.steps},
        "runs": [],
    }
    plan = [(s, n, args.steps) for n in args.nprocs for s in ("ddp", "fsdp2", "fsdp2-no-reshard")]
    if args.bf16_steps:
        plan.append(("fsdp2-bf16", args.nprocs[0], args.bf16_steps))
    for strategy, n, steps in plan:
        r = measure(strategy, n, args.preset, args.batch_size, steps)
        result["runs"].append(r)
        state = max(s["total"] for s in r["state_per_rank"])
        print(
            f"{strategy:18} {n} ranks  {r['tokens_per_s']:9,.0f} tokens/s  state/rank {state / 1e6:7.1f} MB", flush=True
        )
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
