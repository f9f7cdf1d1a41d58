r"""Benchmark DDP against FSDP2 per rank: bytes of model state, peak memory, tokens/s.

    python -m distlab.bench.fsdp --preset shakespeare --batch-size 16 --steps 6 \
        --nprocs 2 4 --repeats 3

For each world size, DDP, FSDP2 and FSDP2 without resharding the blocks after forward
train the same batches, and FSDP2 with bf16 compute (``MixedPrecisionPolicy``) trains
them at the first world size (``--no-bf16`` skips it), all for the same number of steps.
Each run reports the bytes of parameters, gradients and AdamW state one rank holds
(counted from the tensors), the peak bytes PyTorch's memory tracker saw in the last
step, tokens/s over the steps between the warm-up and that tracked (slower) last step,
and the losses. Every row runs ``--repeats`` times, round after round over all rows, so
a slow spell of a shared machine falls on every row; a row keeps each repeat's tokens/s
with their median and spread (min to max), and ``compare`` calls two rows different only
when their spreads do not overlap. Results go to ``--out`` (default
``results/fsdp_bench.json``) with their provenance (CPU flags and load average
included); the FSDP2 chapter reads ``results/fsdp_bench_batch16.json`` and
``results/fsdp_bench_batch64.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from distlab.bench.provenance import finished, provenance, write_result
from distlab.chapters.fsdp2 import train
from distlab.infra import claims
from distlab.infra.experiment import WARMUP_STEPS
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT
from distlab.model import preset as model_preset

# 2: repeats with median and spread; the root kept gathered after forward; bf16 for as
# many steps
SCHEMA = 2


def measure(strategy: str, nprocs: int, preset: str, batch: int, steps: int) -> dict:
    """One run on ``nprocs`` ranks; the peak is tracked in the last step, which is
    not timed."""
    ranks = run_ranks(
        train,
        nprocs=nprocs,
        timeout=3600,
        quiet=True,
        pg_timeout=900,
        args=(strategy, preset, steps, batch, 1337, 1e-3, True),  # track_peak
    )
    # a step ends when its slowest rank does
    step_s = [max(s) for s in zip(*(r["step_s"] for r in ranks))]
    timed = step_s[WARMUP_STEPS:-1]
    return {
        "losses": ranks[0]["losses"],
        "tokens_per_s": batch
        * model_preset(preset).block_size
        / statistics.median(timed),
        "state_per_rank": [r["state_bytes"] for r in ranks],
        "peak_per_rank": [r["peak"] for r in ranks],
    }


def compare(a: dict, b: dict) -> str:
    """Run ``a`` against run ``b`` by tokens/s: "faster" or "slower" only when their
    spreads (min to max over the repeats) do not overlap; else "within noise"."""
    verdict = claims.compare(a["tokens_per_s"], b["tokens_per_s"])
    return {"larger": "faster", "smaller": "slower"}.get(verdict, verdict)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="shakespeare")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument(
        "--steps",
        type=int,
        default=6,
        help=f"steps per run: {WARMUP_STEPS} warm-up, then timed, then 1 tracked",
    )
    parser.add_argument(
        "--nprocs", type=int, nargs="+", default=[2, 4], help="world sizes"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every row, interleaved (at least 3)",
    )
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the bf16 row",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "fsdp_bench.json"))
    args = parser.parse_args(argv)
    if args.steps < WARMUP_STEPS + 2:
        parser.error(
            f"--steps must be at least {WARMUP_STEPS + 2}: {WARMUP_STEPS} "
            "warm-up, 1 timed, 1 tracked"
        )
    if args.repeats < 3:
        parser.error(
            "--repeats must be at least 3: a spread needs more than two points"
        )

    # before the first run: the code that runs
    measured = provenance("distlab.bench.fsdp", argv)
    plan = [(s, n) for n in args.nprocs for s in ("ddp", "fsdp2", "fsdp2-no-reshard")]
    if args.bf16:
        plan.append(("fsdp2-bf16", args.nprocs[0]))
    made: dict[tuple, list[dict]] = {row: [] for row in plan}
    for round_ in range(args.repeats):
        for strategy, n in plan:  # A B C, then A B C again: interleaved
            start = time.perf_counter()
            r = measure(strategy, n, args.preset, args.batch_size, args.steps)
            made[(strategy, n)].append(r)
            print(
                f"[{round_ + 1}/{args.repeats}] {strategy:18} {n} ranks "
                f"{r['tokens_per_s']:9,.0f} tokens/s "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    runs = []
    for (strategy, n), repeats in made.items():
        # losses, bytes and peaks do not depend on the repeat; tokens/s does
        first = repeats[0]
        runs.append(
            {
                "strategy": strategy,
                "world_size": n,
                **{k: v for k, v in first.items() if k != "tokens_per_s"},
                "tokens_per_s": claims.spread([r["tokens_per_s"] for r in repeats]),
            }
        )
    result = {
        "schema": SCHEMA,
        "provenance": finished(measured),
        "workload": {
            "preset": args.preset,
            "global_batch": args.batch_size,
            "steps": args.steps,
            "repeats": args.repeats,
        },
        "runs": runs,
    }
    by_row = {(r["strategy"], r["world_size"]): r for r in runs}
    for n in args.nprocs:
        for strategy in ("fsdp2", "fsdp2-no-reshard"):
            print(
                f"  {strategy} vs ddp, {n} ranks: "
                f"{compare(by_row[(strategy, n)], by_row[('ddp', n)])}"
            )
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
