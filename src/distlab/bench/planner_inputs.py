"""Measure what the planner needs to know about this CPU, as the recorded lab runs
saw it.

    python -m distlab.bench.planner_inputs                  # about a minute on 2 cores
    python -m distlab.bench.planner_inputs --repeats 5 --out /tmp/inputs.json

For N = 1, 2 and 4 ranks at once (gloo CPU ranks through ``run_ranks``, which gives each
rank the threads the labs get: ``cpu_count // N``, at least 1), every rank
measures together:

* the fp32 matmul peak per rank, with ``distlab.flops.measured_peak_flops``, the very
  call each recorded lab run made at its end (``peak_flops_per_s`` there): the planner's
  compute rate;
* the same matmul called back to back for about a second, its median: what a rank
  sustains while the others compute too (on 4 ranks sharing 2 cores the peak's best call
  can land in a moment when another rank waits, and say more than a sustained share of
  a core);
* causal attention (``scaled_dot_product_attention``, the labs' kernel) forward and
  backward at a lab micro-batch's shape (4 sequences of the shakespeare preset: 6 heads,
  256 tokens, 64 wide), its FLOP/s counted as the planner counts them (half of the 4*T*C
  per token, the causal half, x3): the rate the planner's ``attention_efficiency`` is a
  fraction of the peak for;
* a plain copy's bandwidth per rank with all ranks copying at once
  (``distlab.chapters.collectives.copy_bandwidth``: bytes copied per second, each read
  once and written once), at the collectives chapter's largest message (16 MB) and at
  256 MB (past the 32 MB L3 cache of the CI machine, so memory's own rate);
* for N >= 2, the alpha-beta fit of gloo's all-reduce of the collectives chapter
  (``time_collectives`` then ``summarise_timings``, at the sizes ``book/ddp_scaling.md``
  fits on: 1, 4 and 16 KB for alpha, 16 MB for the bandwidth B), and the median time of
  its reduce-scatter and all-gather of 16 MB (FSDP2's collectives), which the fit, made
  on all-reduces, should predict.

Each rank count is launched ``--repeats`` times, the rounds interleaved (1, 2, 4, 1, 2,
4...) so that a busy spell of the shared machine spreads over all of them; the result
keeps every repeat and their median. Written to ``--out`` (default
``results/planner_cpu_inputs.json``) with its provenance.
``distlab.planner.cpu_check`` turns it into the planner's ``Cluster``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from distlab.bench.provenance import finished, load_average, provenance, write_result
from distlab.chapters.collectives import (
    copy_bandwidth,
    summarise_timings,
    time_collectives,
)
from distlab.chapters.ddp_scaling import FIT_SIZES
from distlab.cli import run
from distlab.flops import measured_peak_flops
from distlab.infra.launch import run_ranks
from distlab.infra.paths import RESULTS_DIR
from distlab.runtime import rank_world

SCHEMA = 1
# the collectives chapter's largest message; one far past the L3 cache
COPY_BYTES = (16 * 2**20, 256 * 2**20)
# the peak's matmul size on a CPU, timed back to back this long
SUSTAINED_N, SUSTAINED_S = 2048, 1.0
# a lab micro-batch of the shakespeare preset: sequences, heads, tokens, width
ATTENTION_SHAPE = (4, 6, 256, 64)


def sustained_matmul_flops() -> float:
    """FLOP/s of 2048^3 fp32 matmuls called back to back by every rank at once
    (median call)."""
    a, b = torch.randn(SUSTAINED_N, SUSTAINED_N), torch.randn(SUSTAINED_N, SUSTAINED_N)
    torch.mm(a, b)  # warm-up
    dist.barrier()
    seconds, start = [], time.perf_counter()
    while time.perf_counter() - start < SUSTAINED_S or len(seconds) < 3:
        t = time.perf_counter()
        torch.mm(a, b)
        seconds.append(time.perf_counter() - t)
    return 2 * SUSTAINED_N**3 / statistics.median(seconds)


def attention_flops() -> float:
    """FLOP/s of causal attention forward + backward (median call), every rank at once,
    counted as ``planner.block_seconds`` counts them: 2*C*T per token forward (the
    causal half), twice that backward."""
    B, H, T, D = ATTENTION_SHAPE
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, H, T, D)

    def call() -> float:
        start = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ).backward(grad)
        return time.perf_counter() - start

    call()  # warm-up
    dist.barrier()
    seconds, start = [], time.perf_counter()
    while time.perf_counter() - start < SUSTAINED_S or len(seconds) < 3:
        seconds.append(call())
    return 3 * 2 * (H * D) * T * (B * T) / statistics.median(seconds)


def on_rank() -> dict:
    """One rank's measurements, every rank measuring at the same moments."""
    _, world = rank_world()
    out = {"threads_per_rank": torch.get_num_threads(), "ranks_at_once": world}
    # mean of the ranks'
    out["peak_flops_per_s"] = measured_peak_flops(torch.device("cpu"), torch.float32)
    out["sustained_flops_per_s"] = sustained_matmul_flops()
    out["attention_flops_per_s"] = attention_flops()
    for nbytes in COPY_BYTES:
        dist.barrier()  # copy together: the ranks share the memory's bandwidth
        out[f"copy_{nbytes >> 20}mb_bytes_per_s"] = copy_bandwidth(nbytes)
    if world > 1:
        out["timings"] = time_collectives(FIT_SIZES)
    return out


def one_launch(nprocs: int) -> dict:
    """The measurements of one launch of ``nprocs`` ranks: per rank, medians over the
    ranks, the fit."""
    load_before = load_average()  # a repeat made while other work ran shows it here
    per_rank = run_ranks(on_rank, nprocs=nprocs, timeout=600, device="cpu", quiet=True)
    keys = [k for k in per_rank[0] if k.endswith("_per_s") and k != "peak_flops_per_s"]
    launch = {k: statistics.median(r[k] for r in per_rank) for k in keys}
    # already the ranks' mean, as the labs record it
    launch["peak_flops_per_s"] = per_rank[0]["peak_flops_per_s"]
    launch["threads_per_rank"] = per_rank[0]["threads_per_rank"]
    launch["load_average_before"] = load_before
    if nprocs > 1:
        summary = summarise_timings([r["timings"] for r in per_rank])
        fit = summary["fit"]["dist.all_reduce"]
        launch["all_reduce_alpha_s"], launch["all_reduce_bandwidth"] = (
            fit["alpha"],
            fit["bandwidth"],
        )
        # FSDP2's two collectives, timed at the largest size beside the all-reduce: what
        # the planner's ring, fed the all-reduce's fit, says of them can be checked
        # against these
        for name in ("reduce_scatter", "all_gather"):
            launch[f"{name}_{FIT_SIZES[-1] >> 20}mb_s"] = summary["median"][
                f"dist.{name}_single", FIT_SIZES[-1]
            ]
    return launch


def summarise(launches: list[dict]) -> dict:
    """The median of every quantity over the repeats, and the repeats themselves."""
    numbers = [
        k for k in launches[0] if k not in ("threads_per_rank", "load_average_before")
    ]
    return {
        "threads_per_rank": launches[0]["threads_per_rank"],
        **{k: statistics.median(launch[k] for launch in launches) for k in numbers},
        "repeats": launches,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.bench.planner_inputs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="rank counts (default: 1 2 4)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="launches per rank count (default: 3)"
    )
    parser.add_argument("--out", default=str(RESULTS_DIR / "planner_cpu_inputs.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.ranks) < 1:
        parser.error("--repeats and every --ranks must be at least 1")
    measured = provenance("distlab.bench.planner_inputs", argv, "cpu")
    start = time.perf_counter()
    made: dict[int, list[dict]] = {}
    for _ in range(args.repeats):  # rounds over the rank counts, as distlab.bench does
        for n in args.ranks:
            made.setdefault(n, []).append(one_launch(n))
            print(f"{n} rank(s): {describe(made[n][-1])}", flush=True)
    result = {
        "schema": SCHEMA,
        "provenance": finished(measured),
        "seconds": round(time.perf_counter() - start, 1),
        "copy_counts": (
            "bytes copied per second: each byte read once and written once "
            "(2x that moved)"
        ),
        "alpha_is": (
            "seconds per ring step (the fit's 2(N-1) alpha is a small all-reduce's "
            "time)"
        ),
        "bandwidth_is": (
            "bytes per second each rank sends, the ring's B (book/collectives.md)"
        ),
        "by_ranks": {str(n): summarise(made[n]) for n in sorted(made)},
    }
    write_result(result, args.out)
    return result


def describe(launch: dict) -> str:
    text = (
        f"peak {launch['peak_flops_per_s'] / 1e9:.0f} GFLOP/s/rank, sustained "
        f"{launch['sustained_flops_per_s'] / 1e9:.0f}, attention "
        f"{launch['attention_flops_per_s'] / 1e9:.0f}, "
        f"copy 16 MB {launch['copy_16mb_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"256 MB {launch['copy_256mb_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    if "all_reduce_alpha_s" in launch:
        text += (
            f", alpha {launch['all_reduce_alpha_s'] * 1e6:.0f} us, B "
            f"{launch['all_reduce_bandwidth'] / 1e9:.2f} GB/s, "
            f"16 MB reduce-scatter {launch['reduce_scatter_16mb_s'] * 1e3:.1f} "
            "ms, all-gather "
            f"{launch['all_gather_16mb_s'] * 1e3:.1f} ms"
        )
    return text


if __name__ == "__main__":
    run(main, "python -m distlab.bench.planner_inputs")
