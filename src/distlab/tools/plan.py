"""Plan a run from the command line: memory per GPU, step time and tokens/s, or the
plans ranked.

    python -m distlab.tools.plan --model llama3-8b --gpu a100-80gb --gpus 64 \\
        --network ib-200g --strategy fsdp2 --ac selective-op --micro-batch 1 \\
        --seq-len 8192
    python -m distlab.tools.plan --model llama3-70b --gpu h100-sxm --gpus 128 \\
        --network ib-400g --seq-len 8192 --recommend --global-batch 256

Every number is the planner's (``distlab.tools.planner``), explained term by term in
book/planner.md, where it is checked against this machine's runs and published ones.
"""

from __future__ import annotations

import argparse
import sys

from distlab.tools.calculator_page import format_bytes
from distlab.tools.hardware import GPUS, NETWORKS
from distlab.tools.planner import (
    AC_MODES,
    PRECISIONS,
    STRATEGIES,
    Plan,
    gpu_cluster,
    predict,
)
from distlab.tools.recommend import explain, recommend
from distlab.tools.shapes import SHAPES, shape


def report(p: dict) -> str:
    """The prediction as lines: memory by part, time by part, throughput."""
    m, t = p["memory"], p["time"]
    lines = [
        f"memory per GPU {'fits' if m['fits'] else 'DOES NOT FIT'} "
        f"({format_bytes(m['capacity'])} on the GPU)"
    ]
    parts = [part for part in m if part not in ("total", "state", "capacity", "fits")]
    lines += [f"  {part:14} {format_bytes(m[part]):>10}" for part in parts]
    lines.append(
        f"  {'total':14} {format_bytes(m['total']):>10}  (at the peak; model "
        "state held all along: "
        f"{format_bytes(m['state'])})"
    )
    lines.append(
        f"step {t['step']:.4g} s = compute {t['compute']:.4g} + exposed "
        f"communication {t['exposed']:.4g}"
        f" + optimizer {t['optimizer']:.4g}"
    )
    for part in ("matmul", "attention", "memory-bound", "recompute"):
        lines.append(f"  {part:14} {t[part]:.4g} s")
    for name, seconds in t["collectives"].items():
        lines.append(f"  {name:14} {seconds:.4g} s on the wire")
    lines.append(
        f"{p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {p['mfu']:.1%}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.tools.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help=f"one of {', '.join(SHAPES)}")
    parser.add_argument("--gpu", required=True, help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--network", help=f"between nodes: one of {', '.join(NETWORKS)}"
    )
    parser.add_argument(
        "--strategy", default="fsdp2", help=f"one of {', '.join(STRATEGIES)}"
    )
    parser.add_argument(
        "--group", type=int, help="hsdp: GPUs that shard (the rest replicate)"
    )
    parser.add_argument("--ac", default="none", help=f"one of {', '.join(AC_MODES)}")
    parser.add_argument(
        "--ac-every",
        type=int,
        default=2,
        help="selective-layer: every k-th block checkpointed",
    )
    parser.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per GPU per forward"
    )
    parser.add_argument(
        "--accum", type=int, default=1, help="micro-batches per optimizer step"
    )
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument(
        "--precision", default="bf16", help=f"one of {', '.join(PRECISIONS)}"
    )
    parser.add_argument(
        "--recommend", action="store_true", help="rank every plan that fits instead"
    )
    parser.add_argument(
        "--global-batch", type=int, help="--recommend: sequences per optimizer step"
    )
    args = parser.parse_args(argv)
    try:
        model, cluster = (
            shape(args.model),
            gpu_cluster(args.gpu, args.gpus, args.gpus_per_node, args.network),
        )
        if args.recommend:
            batch = args.global_batch or args.gpus * args.micro_batch * args.accum
            print(
                explain(recommend(model, cluster, args.seq_len, batch, args.precision))
            )
            return 0
        plan = Plan(
            args.strategy,
            args.micro_batch,
            args.seq_len,
            args.accum,
            args.ac,
            args.ac_every,
            args.precision,
            group=args.group,
        )
        print(report(predict(model, cluster, plan)))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
