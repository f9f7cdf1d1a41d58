"""Plan a run from the command line: memory per GPU, step time and tokens/s, or the
plans ranked.

    python -m distlab.planner --model llama3-8b --gpu a100-80gb --gpus 64 \\
        --network ib-200g --strategy fsdp2 --ac selective-op --micro-batch 1 \\
        --seq-len 8192
    python -m distlab.planner --model llama3-70b --gpu h100-sxm --gpus 128 \\
        --network ib-400g --seq-len 8192 --recommend --global-batch 256
    python -m distlab.planner --validate    # every published run, left out in turn
    python -m distlab.planner --validate --by source   # its whole source left out

tokens/s and memory print as ranges: the planner at the GEMM efficiencies the published
runs of that GPU kind imply, and its memory times what the runs that report memory
published over what it predicted (``distlab.planner.calibrate``).

Every number is the planner's (``distlab.planner.predict``), explained term by term in
book/planner.md, where it is checked against this machine's runs and published ones.
"""

from __future__ import annotations

import argparse
import sys

from distlab.infra.tables import format_bytes
from distlab.planner.calibrate import (
    calibration,
    gpu_of,
    leave_one_out,
    predict_range,
    run_named,
)
from distlab.planner.hardware import GPUS, NETWORKS
from distlab.planner.predict import (
    AC_MODES,
    PRECISIONS,
    STRATEGIES,
    Plan,
    gpu_cluster,
    predict,
)
from distlab.planner.recommend import explain, recommend
from distlab.planner.shapes import SHAPES, shape

GiB = 2**30


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


def range_report(r: dict) -> str:
    """The calibrated ranges as lines."""
    (tlo, tmid, thi) = r["tokens_per_s_per_gpu"]
    elo, _, ehi = r["efficiency"]
    n = len(r["calibrated_on"])
    lines = [
        f"tokens/s per GPU {tlo:,.0f} to {thi:,.0f} (middle {tmid:,.0f}): GEMMs at",
        f"  {elo:.0%} to {ehi:.0%} of the peak, as {n} published runs imply",
    ]
    if r["memory"] is None:
        return "\n".join(lines + ["memory: no published run reports it to calibrate"])
    (mlo, mmid, mhi), (qlo, _, qhi) = r["memory"], r["memory_ratio"]
    return "\n".join(
        lines
        + [
            f"memory per GPU {mlo / GiB:.1f} to {mhi / GiB:.1f} GiB (middle "
            f"{mmid / GiB:.1f}): the",
            f"  prediction x {qlo:.2f} to {qhi:.2f}, published over predicted of the",
            f"  {r['memory_runs']} runs that report memory",
        ]
    )


def validation_table(rows: list[dict]) -> str:
    """Leave-one-out: each run predicted from the others, with the GEMM efficiency it
    implies itself and its memory against the published."""
    lines = [
        f"{'run':44} {'published':>9} {'predicted (low-high)':>24} {'error':>6} "
        f"{'implied':>7} {'memory':>7}"
    ]
    for r in rows:
        if "predicted" in r:
            lo, mid, hi = r["predicted"]
            pred = f"{mid:,.0f} ({lo:,.0f}-{hi:,.0f})"
            err = f"{r['error']:+.0%}" + ("" if r["inside"] else "*")
        else:
            pred, err = r["why_not"][:24], ""
        eff = f"{r['implied_efficiency']:.3f}" if "implied_efficiency" in r else ""
        mem = f"{r['memory_error']:+.0%}" if "memory_error" in r else ""
        lines.append(
            f"{r['run'][:44]:44} {r['published']:>9,.0f} {pred:>24} {err:>6} "
            f"{eff:>7} {mem:>7}"
        )
    lines += [
        "error: the middle against the published, * outside the range; implied: the",
        "GEMM efficiency (of the bf16 peak) at which the planner gives the run's own",
        "tokens/s; memory: the middle of the memory range against the published",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help=f"one of {', '.join(SHAPES)}")
    parser.add_argument("--gpu", help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--gpus", type=int, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--network", help=f"between nodes: one of {', '.join(NETWORKS)}"
    )
    parser.add_argument(
        "--busbw",
        type=float,
        help="GB/s: your nccl-tests all_reduce busbw across the nodes, at the size "
        "of the shards (instead of NCCL's channel-per-NIC estimate)",
    )
    parser.add_argument(
        "--leave-out",
        metavar="RUN",
        help="calibrate without this published run (python -m distlab.planner "
        "--validate lists them)",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="predict every published run from the others and print the table",
    )
    parser.add_argument(
        "--by",
        choices=("run", "source"),
        default="run",
        help="--validate: leave out one run at a time, or its whole source",
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
    if args.validate:
        print(validation_table(leave_one_out(args.by)))
        return 0
    missing = [f"--{a}" for a in ("model", "gpu", "gpus") if getattr(args, a) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    try:
        if args.leave_out is not None:
            run_named(args.leave_out)
        busbw = args.busbw * 1e9 if args.busbw is not None else None
        model, cluster = (
            shape(args.model),
            gpu_cluster(args.gpu, args.gpus, args.gpus_per_node, args.network, busbw),
        )
        if args.recommend:
            batch = args.global_batch or args.gpus * args.micro_batch * args.accum
            c = calibration(gpu_of(cluster), args.leave_out)
            ranked = recommend(
                model,
                cluster,
                args.seq_len,
                batch,
                args.precision,
                c["efficiency"][1],
                c["memory_ratio"][1],
            )
            print(explain(ranked))
            print(
                f"(GEMMs at {c['efficiency'][1]:.0%} of the peak and memory x "
                f"{c['memory_ratio'][1]:.2f}: the middle of the calibration)"
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
        try:
            r = predict_range(model, cluster, plan, exclude=args.leave_out)
        except ValueError as err:  # too few runs of this GPU kind to calibrate
            print(report(predict(model, cluster, plan)))
            print(f"not calibrated ({err}): GEMMs at the microbenchmark's efficiency")
            return 0
        p = predict(model, cluster, plan, r["efficiency"][1])
        print(report(p))
        floor = GPUS[args.gpu].bf16_peak_floor
        if floor:
            print(
                f"  (the MFU is of a peak of {GPUS[args.gpu].bf16_peak / 1e12:.0f} "
                f"TFLOP/s, an upper bound for this part; at {floor / 1e12:.0f} it "
                f"reads {p['mfu'] * GPUS[args.gpu].bf16_peak / floor:.1%})"
            )
        print(range_report(r))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
