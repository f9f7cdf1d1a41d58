"""The experiments of book/ddp_scaling.md: the DDP step model
(``distlab.tools.step_model``) checked against this machine, and its inputs for GPUs.

    # one cheap launch: the alpha-beta fit, and DDP's exposed all-reduce
    # measured directly
    measured = run_ranks(measure_on_ranks, nprocs=2)
    cpu_check(measured)        # the model's exposed time against it
    recorded_runs_check(link)  # ... and the recorded 1/2/4-rank runs
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.chapters.collectives import summarise_timings, time_collectives
from distlab.chapters.ddp_internals import bucket_layouts
from distlab.flops import DATASHEET_PEAKS
from distlab.infra.paths import RESULTS_DIR
from distlab.model import GPT, preset
from distlab.runtime import rank_world
from distlab.tools.step_model import (
    ASSUMED_MFU,
    Link,
    backward_done,
    bucket_sizes,
    ddp_default_buckets,
    ddp_schedule,
    ddp_step,
    gradient_bytes,
)

# 1, 4, 16 KB for the latency; 16 MB for the bandwidth
FIT_SIZES = [2**10, 2**12, 2**14, 2**24]
# little compute, the whole 43 MB gradient
CHECK_PRESET, CHECK_SEQ, CHECK_BATCH = "shakespeare", 64, 1
H100_BF16 = next(
    peaks["bf16"] for _, gpu, peaks in DATASHEET_PEAKS if gpu == "H100 SXM"
)
# the model's GPU compute rate: an assumption, stated on the page
GPU_FLOPS = ASSUMED_MFU * H100_BF16
# GPT-2 small: the gpt2 preset's shape with GPT-2's 50,257-token vocabulary
GPT2_SMALL = preset("gpt2", vocab_size=50257)
# A published all_reduce_perf run at DDP's bucket sizes: 2 nodes of 8 H20s "with NVL
# SHARP", the out-of-place time (us) of each size (bytes), from nvidia/nccl#1244
NCCL_1244 = "https://github.com/NVIDIA/nccl/issues/1244"
NCCL_1244_ROWS = [
    (2**20, 121.8),
    (2**21, 129.8),
    (2**22, 127.6),
    (2**23, 146.5),
    (2**24, 203.0),
    (2**25, 298.5),
    (2**26, 467.9),
]
RECORDED = RESULTS_DIR / "bench" / "cpu_shakespeare_fp32.json"
# when an H200's backward completed each gradient (distlab.bench.backward_ready)
BACKWARD_READY = RESULTS_DIR / "backward_ready_bench.json"
DDP_BENCH = RESULTS_DIR / "ddp_bench.json"


# --- begin exposed ---
def exposed_all_reduce(steps: int = 8) -> dict:
    """On every rank: one step's time with DDP's all-reduce and without it
    (``no_sync``), pairs interleaved so that a slow moment of the machine hits both; the
    difference is what the all-reduce adds to the step, measured directly."""
    rank, _ = rank_world()
    model = DDP(GPT(preset(CHECK_PRESET, block_size=CHECK_SEQ)))
    g = torch.Generator().manual_seed(rank)
    x, y = (
        torch.randint(0, 65, (CHECK_BATCH, CHECK_SEQ), generator=g) for _ in range(2)
    )

    def step(sync: bool) -> float:
        # start together: a rank's all-reduce waits for the slower rank anyway
        dist.barrier()
        start = time.perf_counter()
        if sync:
            # the buckets' all-reduces run, and backward() waits for them
            model(x, y)[1].backward()
        else:
            with model.no_sync():  # gradients accumulate locally: no all-reduce at all
                model(x, y)[1].backward()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up; DDP rebuilds its buckets after the first step
        step(True), step(False)
    with_sync, without = zip(*((step(True), step(False)) for _ in range(steps)))
    return {
        "with": list(with_sync),
        "without": list(without),
        "threads": torch.get_num_threads(),
    }


# --- end exposed ---


def real_buckets(caps_mb=(None, 1.0)) -> dict:
    """Torch DDP's own bucket sizes (bytes, launch order) for the check's model, from
    its second step on, with ``bucket_cap_mb`` not passed (None) and passed."""
    return {
        cap: [
            size
            for size, _ in bucket_layouts(CHECK_PRESET, cap)["layouts"][
                "from forward 2 on"
            ]
        ]
        for cap in caps_mb
    }


def measure_on_ranks(steps: int = 8) -> dict:
    """Everything the page measures, in one launch: DDP's real buckets, the alpha-beta
    timings, then ``steps`` pairs of DDP steps."""
    return {
        "buckets": real_buckets(),
        "timings": time_collectives(FIT_SIZES),
        "exposed": exposed_all_reduce(steps),
    }


def fitted_link(per_rank: list[dict]) -> Link:
    fit = summarise_timings([r["timings"] for r in per_rank])["fit"]["dist.all_reduce"]
    return Link(
        "gloo loopback (this machine)",
        fit["alpha"],
        fit["bandwidth"],
        "fitted on this page",
    )


def cpu_check(per_rank: list[dict]) -> dict:
    """The model's exposed all-reduce time for the check's model on 2 ranks, with and
    without overlap, against the measured difference (median over the pairs, each pair's
    slower rank)."""
    link, n = fitted_link(per_rank), len(per_rank)
    with_sync = [max(ts) for ts in zip(*(r["exposed"]["with"] for r in per_rank))]
    without = [max(ts) for ts in zip(*(r["exposed"]["without"] for r in per_rank))]
    measured = statistics.median(w - wo for w, wo in zip(with_sync, without))
    compute = statistics.median(without)
    # the sequence length changes no weight
    buckets = ddp_default_buckets(preset(CHECK_PRESET))
    no_overlap = ddp_step(compute, buckets, n, link, overlap=False)
    overlap = ddp_step(compute, buckets, n, link, overlap=True)
    return {
        "link": link,
        "buckets": buckets,
        "compute": compute,
        "step_with": statistics.median(with_sync),
        "measured_exposed": measured,
        "predicted_exposed": no_overlap["exposed"],
        "predicted_if_overlapped": overlap["exposed"],
        "ratio": no_overlap["exposed"] / measured,
        "threads": per_rank[0]["exposed"]["threads"],
    }


def recorded_runs_check(link: Link) -> list[dict]:
    """Lab 2's recorded tokens/s at 1, 2 and 4 ranks against the model: the 1-rank run's
    step time (its compute, with both cores), which N ranks on the same 2 cores split N
    ways, plus the whole all-reduce of the gradient, which cannot overlap
    (``overlap=False``), at the link fitted here."""
    runs = json.loads(RECORDED.read_text())
    lab1 = next(r for r in runs["runs"] if r["lab"] == "lab1_single")
    one_rank_step = lab1["tokens_per_step"] / lab1["tokens_per_s"]
    buckets = ddp_default_buckets(preset(runs["workload"]["preset"]))
    rows = []
    for run in (r for r in runs["runs"] if r["lab"] == "lab2_ddp"):
        n = run["world_size"]
        step = ddp_step(one_rank_step, buckets, n, link, overlap=False)["step"]
        predicted = run["tokens_per_step"] / step
        rows.append(
            {
                "ranks": n,
                "threads": run["peak_measured_with"]["threads_per_rank"],
                "predicted": predicted,
                "measured": run["tokens_per_s"],
                "ratio": predicted / run["tokens_per_s"],
            }
        )
    return rows


def bucket_sweep(link: Link) -> list[dict]:
    """The recorded ``bucket_cap_mb`` sweep (2 ranks, shakespeare, 8 sequences of 256
    per rank) next to the model's step time at the same caps, on this machine's link,
    without overlap."""
    bench = json.loads(DDP_BENCH.read_text())
    rows_by_name, grads = bench["rows"], gradient_bytes(preset("shakespeare"))
    lab1 = rows_by_name["lab1_single"]["tokens_per_s"]["median"]
    tokens = bench["workload"]["global_batch"] * preset("shakespeare").block_size
    rows = []
    for row in rows_by_name.values():
        if row.get("bucket_cap_mb") is None:
            continue
        buckets = bucket_sizes(grads, int(row["bucket_cap_mb"] * 2**20))
        step = ddp_step(tokens / lab1, buckets, row["ranks"], link, overlap=False)[
            "step"
        ]
        spread = row["tokens_per_s"]
        rows.append(
            {
                "cap": row["bucket_cap_mb"],
                "buckets": len(buckets),
                "predicted": tokens / step,
                "median": spread["median"],
                "min": spread["min"],
                "max": spread["max"],
            }
        )
    return rows


def recorded_ready(cfg=GPT2_SMALL) -> dict:
    """The recorded GPU backward against the model's estimate: the fraction of backward
    done when the first gradient is complete, and when each of DDP's buckets is ready
    (its last gradient, by the recorded median)."""
    result = json.loads(BACKWARD_READY.read_text())
    measured = {n: f["median"] for n, f in result["ready_fraction"].items()}
    names = [n for n, _ in _named_parameters(cfg)][::-1]  # backward's order
    sizes = gradient_bytes(cfg)[::-1]
    buckets, model_ready = ddp_schedule(cfg)
    ready, filled, k, names_in = [], 0, 0, []
    for name, size in zip(names, sizes):
        filled, names_in = filled + size, names_in + [name]
        if filled == sum(buckets[: k + 1]):
            ready.append(max(measured[n] for n in names_in))
            k, names_in = k + 1, []
    return {
        "first": (names[0], measured[names[0]], backward_done(cfg)[0]),
        "last": max(measured, key=measured.get),
        "buckets": buckets,
        "measured": ready,
        "model": model_ready,
        "backward_ms": result["backward_ms"],
        "machine": result["provenance"]["machine"],
        "batch": result["workload"]["batch"],
    }


def _named_parameters(cfg):
    import torch

    with torch.device("meta"):
        return list(GPT(cfg).named_parameters())


def crossover_bytes(costs, first: str, second: str, sizes=None) -> float | None:
    """The smallest size at which ``second`` becomes faster than ``first`` (None if it
    never does)."""
    sizes = sizes or [2.0**k for k in range(6, 36)]
    return next((s for s in sizes if costs(s)[second] < costs(s)[first]), None)
