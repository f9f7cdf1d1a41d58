"""The planner chapter's experiments: one FSDP2 step on a timeline, what one Llama block
keeps, NCCL's bus bandwidth across nodes, the calibration on published runs and its
leave-one-out check, the recommender, and this machine's recorded runs.

Nothing here runs ranks: the planner is arithmetic (``distlab.planner``), and what it is
checked against is published (``distlab.planner.runs``, each number quoted with its
source) or recorded (``results/``). Every table reads ``RUNS`` whole, so a run added
there appears on the page with no edit here.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

from distlab.costs.activations import held_bytes_per_token, held_values_per_token
from distlab.costs.collectives import cross_node_busbw
from distlab.costs.state import per_rank_bytes
from distlab.planner.calibrate import (
    ASSUMED_NETWORK,
    calibration,
    implied_efficiency,
    inputs,
    leave_one_out,
    predict_range,
)
from distlab.planner.comm import communication
from distlab.planner.cpu_check import (
    INPUTS,
    RECORDED,
    check_recorded,
    collectives_check,
)
from distlab.planner.hardware import GPUS, NETWORKS
from distlab.planner.predict import OPTIMIZER, block_seconds, gpu_cluster, predict
from distlab.planner.recommend import recommend
from distlab.planner.runs import RUNS, RUNS_BY_NAME
from distlab.planner.shapes import SHAPES

# the run the page opens with: torchtitan's Llama 3.1 8B, FSDP2, 8 H100s, eager bf16
KEY_RUN = "torchtitan-h100-8b-fsdp-8gpu"
TARGET = 0.15  # the target: median |error| of tokens/s, leave-one-out
MISS = 0.30  # and no run beyond this unexplained
MEMORY_TARGET = 0.10  # memory per GPU, where the run reports it
GiB = 2**30


# --- begin headline ---
def headline(name: str = KEY_RUN) -> dict:
    """The run predicted as a range by the planner calibrated on the other runs."""
    run = RUNS_BY_NAME[name]
    r = predict_range(*inputs(run), exclude=name)
    tps, mem = (
        run["published"]["tokens_per_s_per_gpu"],
        run["published"].get("memory_bytes_per_gpu"),
    )
    lo, _, hi = r["tokens_per_s_per_gpu"]
    mlo, _, mhi = r["memory"]
    return {
        **r,
        "run": run,
        "published": tps,
        "published_memory": mem,
        "inside": lo <= tps <= hi,
        "memory_inside": mem is not None and mlo <= mem <= mhi,
    }


# --- end headline ---


def step_timeline(name: str = KEY_RUN) -> dict:
    """One micro-batch of the run's FSDP2 step, per block, at the middle efficiency the
    other runs imply: the spans of ``communication(...)["lanes"]`` and the stretches
    where the compute lane waits (the exposed communication)."""
    run = RUNS_BY_NAME[name]
    shape, cluster, plan = inputs(run)
    eff = predict_range(shape, cluster, plan, exclude=name)["efficiency"][1]
    device = dataclasses.replace(cluster.device, matmul_efficiency=eff)
    blocks = block_seconds(shape, device, plan)
    comm = communication(
        shape, dataclasses.replace(cluster, device=device), plan, blocks
    )
    spans = comm["lanes"]
    compute = sorted((s, e) for lane, _, s, e in spans if lane == "compute")
    end = max(e for *_, e in spans)
    waits, clock = [], 0.0
    for s, e in [*compute, (end, end)]:
        if s > clock + 1e-12:
            waits.append((clock, s))
        clock = max(clock, e)
    return {
        "spans": spans,
        "waits": waits,
        "exposed": comm["exposed"],
        "step": end,
        "blocks": blocks,
        "efficiency": eff,
        "n_layer": shape.n_layer,
        "run": run,
    }


def held_rows(dim=256, n_head=4, n_kv_head=2, ffn_hidden=704, dtype="bfloat16"):
    """What one torchtitan-style block keeps for backward without AC, tensor by
    tensor, measured on this CPU (``distlab.planner.llama_block``)."""
    import torch

    from distlab.planner.llama_block import BlockShape, measure_held

    shape = BlockShape(dim, n_head, n_kv_head, ffn_hidden)
    out = {}
    for ac in ("none", "selective-op", "full"):
        held = measure_held(shape, ac, getattr(torch, dtype))
        formula = held_bytes_per_token(
            shape.dim, shape.kv_dim, shape.ffn_hidden, shape.n_head, ac, "bf16"
        )
        out[ac] = {"held": held, "formula": formula, "shape": shape}
    return out


def llama_held(name: str = "llama3-8b") -> dict[str, float]:
    """Values per token one block of ``name`` keeps (bf16), block input left out."""
    s = SHAPES[name]
    return {
        ac: held_values_per_token(
            s.d_model, s.kv_dim, s.ffn_hidden, s.n_head, ac, "bf16"
        )
        for ac in ("none", "selective-op", "full")
    }


def busbw_rows(run: str = "torchtitan-llama3-8b-sel-op") -> list[dict]:
    """NCCL's bus bandwidth across nodes for 1 to 8 NICs per node, and what it does to
    the run's prediction at the middle efficiency the other runs imply."""
    shape, cluster, plan = inputs(RUNS_BY_NAME[run])
    eff = predict_range(shape, cluster, plan, exclude=run)["efficiency"][1]
    gpu = next(k for k, g in GPUS.items() if g.label == cluster.device.name)
    cap = GPUS[gpu].nvlink_bandwidth
    rows = []
    for net in ("ib-200g", "ib-400g"):
        nic = NETWORKS[net].nic_bandwidth
        for nics in (1, 2, 4, 8):
            bw = cross_node_busbw(nics, nic, cap)
            c = gpu_cluster(gpu, cluster.gpus, cluster.gpus_per_node, net, busbw=bw)
            p = predict(shape, c, plan, eff)
            rows.append(
                {
                    "nic": f"{nic * 8 / 1e9:.0f} Gb/s",
                    "nics": nics,
                    "busbw": bw,
                    "capped": bw == cap,
                    "tokens_per_s": p["tokens_per_s_per_gpu"],
                    "exposed": p["time"]["exposed"] / p["time"]["step"],
                }
            )
    return rows


def before_and_after() -> list[dict]:
    """The A100 rows that state no network, predicted as the planner did before (one
    NIC's line rate, GEMMs at MAMF's efficiency) and with NCCL's channel per NIC at the
    same efficiency: how the old agreement came about (review #1, #2)."""
    rows = []
    for run in RUNS:
        if run["network"] is not None or run["gpus"] <= 8:
            continue
        shape, cluster, plan = inputs(run)
        net = NETWORKS[ASSUMED_NETWORK]
        gpu = next(k for k, g in GPUS.items() if g.label == cluster.device.name)
        one_nic = gpu_cluster(gpu, cluster.gpus, 8, net.name, busbw=net.nic_bandwidth)
        old = predict(shape, one_nic, plan)["tokens_per_s_per_gpu"]
        new = predict(shape, cluster, plan)["tokens_per_s_per_gpu"]
        published = run["published"]["tokens_per_s_per_gpu"]
        rows.append(
            {
                "run": run["name"],
                "published": published,
                "one_nic": old / published - 1,
                "nccl": new / published - 1,
                "busbw_old": net.nic_bandwidth,
                "busbw_new": cluster.inter.busbw,
            }
        )
    return rows


def implied_rows() -> list[dict]:
    """Per run: the GEMM efficiency at which the planner gives its published tokens/s,
    and the step it implies (tokens per GPU per step over tokens/s). For the 96 GB H100
    the efficiency is also given against the NVL's peak, the other end of the bracket
    torchtitan's footnote states."""
    rows = []
    for run in RUNS:
        if run["plan"].get("float8"):
            continue
        p, tps = run["plan"], run["published"]["tokens_per_s_per_gpu"]
        eff = implied_efficiency(run)
        peak = GPUS[run["gpu"]].bf16_peak
        rows.append(
            {
                "run": run["name"],
                "gpu": run["gpu"],
                "compile": bool(p.get("compile")),
                "efficiency": eff,
                # against the lowest the peak may be, where the datasheet's is only
                # an upper bound (the 96 GB H100: "between SXM and NVL")
                "efficiency_nvl": eff * peak / GPUS[run["gpu"]].bf16_peak_floor
                if GPUS[run["gpu"]].bf16_peak_floor
                else None,
                "step_s": p["micro_batch"]
                * p["accum_steps"]
                * run["model"]["seq_len"]
                / tps,
            }
        )
    return rows


def validation() -> dict:
    """Leave-one-out over every run, and the counts the page states."""
    rows = leave_one_out()
    timed = [r for r in rows if "error" in r]
    by_source = [r for r in leave_one_out(by="source") if "error" in r]
    mem = [r for r in rows if "memory_error" in r]
    errors = [abs(r["error"]) for r in timed]
    return {
        "rows": rows,
        "timed": timed,
        # torchtitan's A100 and H100 tables are one source
        "sources": len({r["source"].split(" ")[0] for r in rows}),
        "median": statistics.median(errors),
        "inside": sum(r["inside"] for r in timed),
        "over_miss": [r for r in timed if abs(r["error"]) > MISS],
        "outside": [r for r in timed if not r["inside"]],
        "memory": mem,
        "memory_worst": max((abs(r["memory_error"]) for r in mem), default=0.0),
        "not_modelled": [r for r in rows if "error" not in r],
        # the harder test: every run of a run's source left out with it
        "by_source": by_source,
        "by_source_median": statistics.median(abs(r["error"]) for r in by_source),
        "by_source_worst": max(abs(r["error"]) for r in by_source),
    }


def recommendation(top: int = 4) -> dict:
    """Llama 3 8B on 64 H100s (8 nodes, 8 x 400 Gb/s NICs each), 256 sequences of 8,192
    tokens per step, ranked at the middle of the H100's calibration: the ranking, and
    where the best hybrid-sharded plan lands."""
    cluster = gpu_cluster("h100-sxm", 64, 8, "ib-400g")
    c = calibration("h100-sxm")
    ranked = recommend(
        SHAPES["llama3-8b"],
        cluster,
        8192,
        256,
        efficiency=c["efficiency"][1],
        memory_ratio=c["memory_ratio"][1],
    )
    hsdp = [i for i, (plan, _) in enumerate(ranked) if plan.strategy == "hsdp"]
    return {
        "ranked": ranked,
        "calibration": c,
        "first": ranked[0][0],
        "hsdp_rank": hsdp[0] + 1 if hsdp else None,
        "hsdp_in_top": sum(plan.strategy == "hsdp" for plan, _ in ranked[:top]),
        "top": top,
    }


def memory_rows() -> list[dict]:
    """llm.c's GPT-2 1.5B log lists the buffers it allocates before its first step
    (all it ever holds) against the planner's parts."""
    rows = []
    for run in RUNS:
        printed = run["published"].get("allocations_mib")
        if not printed:
            continue
        shape, cluster, plan = inputs(run)
        # llm.c accumulates into its one gradient buffer: no DDP buckets
        state = per_rank_bytes(
            shape.n_params(), cluster.gpus, plan.state, OPTIMIZER, plan.strategy
        )
        activations = predict(shape, cluster, plan)["memory"]["activations"]
        pairs = {
            "parameters": (printed["params"], state["params"]),
            "gradients": (printed["grads"], state["grads"]),
            "AdamW moments, master": (
                printed["adam_m"] + printed["adam_v"] + printed["master"],
                state["optimizer"],
            ),
            "activations": (printed["activations"], activations),
        }
        for part, (mib, predicted) in pairs.items():
            rows.append(
                {
                    "run": run["name"],
                    "part": part,
                    "printed": mib * 2**20,
                    "predicted": predicted,
                    "error": predicted / (mib * 2**20) - 1,
                }
            )
    return rows


def cpu_rows() -> list[dict]:
    """The recorded CPU runs of labs 1-5 predicted from this machine's measured inputs
    (``distlab.planner.cpu_check``), at the peak the runs timed and at the rate a rank
    sustains."""
    inputs_, recorded = (json.loads(path.read_text()) for path in (INPUTS, RECORDED))
    at_peak = check_recorded(inputs_, recorded, "peak", "measured")
    sustained = check_recorded(inputs_, recorded, "sustained", "measured")
    rows = []
    for r, s in zip(at_peak, sustained):
        t, p = r["tokens_per_s"], r["peak_bytes"]
        rows.append(
            {
                "lab": r["lab"],
                "ranks": r["ranks"],
                "measured": t["measured"],
                "predicted": t["predicted"],
                "error": t["error_pct"] / 100,
                "error_sustained": s["tokens_per_s"]["error_pct"] / 100,
                "peak_error": p["error_pct"] / 100,
                "state_error": r["state_bytes"]["error_pct"] / 100,
            }
        )
    return rows


def gloo_collectives() -> tuple[float, float]:
    """gloo's all-gather and reduce-scatter of 16 MB on 2 and 4 ranks, measured, over
    what the ring fed the all-reduce's alpha-beta fit predicts: (lowest, highest)."""
    rows = collectives_check(json.loads(INPUTS.read_text()))
    ratios = [r["measured_s"] / r["predicted_s"] for r in rows]
    return min(ratios), max(ratios)
