"""Benchmark DDP communication hooks: bytes per step, step time and loss, per hook.

    # 2 gloo CPU ranks, shakespeare
    python -m distlab.bench.comm_hooks
    # GPUs (NCCL), DDP's buckets
    python -m distlab.bench.comm_hooks --device cuda --nprocs 2 --bucket-cap-mb 0

Every hook of book/ddp_overlap.md (fp32 through ``allreduce_hook``, fp16, bf16, PowerSGD
at rank 1, 2 and 4) trains the same model from the same weights on the same batches, one
after another, on ``--nprocs`` ranks; each gets the median seconds of forward + backward
(the all-reduces included) after ``--warmup`` untimed steps with every timed step kept
(``spread_s``: repeats, median, min, max, so that a page can ``compare`` two hooks),
the bytes handed to ``dist.all_reduce`` in its last step, and the validation loss at
the end. Results go to ``--out`` (default ``results/comm_hooks_bench.json``) with their
provenance.

On CPU ranks the default is one bucket (``--bucket-cap-mb 1000``): PowerSGD's follow-up
all-reduces are issued from gloo's worker threads, and with several buckets the ranks
can issue them in different orders (the page shows why). ``--bucket-cap-mb 0`` leaves
DDP's default buckets, for NCCL.
"""

import argparse
import statistics

from distlab.bench.provenance import finished, provenance, write_result
from distlab.chapters.ddp_overlap import train_with_hook
from distlab.cli import run
from distlab.infra.claims import spread
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT

VARIANTS = ("fp32", "fp16", "bf16", "powersgd-1", "powersgd-2", "powersgd-4")


def on_rank(
    preset: str,
    steps: int,
    warmup: int,
    rows: int,
    tokens: int,
    bucket_cap_mb: float | None,
) -> dict:
    out = {}
    for variant in VARIANTS:
        r = train_with_hook(
            variant,
            steps + warmup,
            rows,
            tokens,
            preset_name=preset,
            bucket_cap_mb=bucket_cap_mb,
        )  # PowerSGD compresses from step 2 (start_powerSGD_iter=2): warm up past it
        out[variant] = {
            "median_s": statistics.median(r["seconds"][warmup:]),
            "spread_s": spread(r["seconds"][warmup:]),
            "bytes_last_step": sum(b for *_, b in r["calls"][-1]),
            "all_reduces_last_step": len(r["calls"][-1]),
            "val_loss": r["val_loss"],
            "final_loss": r["losses"][-1],
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset", default="shakespeare", help="model preset (default: shakespeare)"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per hook (default: 10)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps first, at least 2 (default: 3)",
    )
    parser.add_argument(
        "--rows", type=int, default=4, help="sequences per rank per step (default: 4)"
    )
    parser.add_argument(
        "--tokens", type=int, default=128, help="tokens per sequence (default: 128)"
    )
    parser.add_argument("--nprocs", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the ranks run (default: cpu)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=1000.0,
        help="0: DDP's default (default: 1000)",
    )
    parser.add_argument(
        "--out", default=str(REPO_ROOT / "results" / "comm_hooks_bench.json")
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.rows, args.tokens, args.nprocs) < 1 or args.warmup < 2:
        parser.error(
            "--steps, --rows, --tokens and --nprocs must be positive, --warmup "
            "at least 2"
        )
    cap = args.bucket_cap_mb or None
    result = {
        "provenance": provenance("distlab.bench.comm_hooks", argv, args.device),
        "workload": {
            k: getattr(args, k)
            for k in ("preset", "steps", "warmup", "rows", "tokens", "nprocs")
        },
        "bucket_cap_mb": cap,
    }
    args_for_ranks = (args.preset, args.steps, args.warmup, args.rows, args.tokens, cap)
    result["by_rank"] = run_ranks(
        on_rank, args.nprocs, args_for_ranks, timeout=3600, device=args.device
    )
    finished(result["provenance"])
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    run(main, "python -m distlab.bench.comm_hooks")
