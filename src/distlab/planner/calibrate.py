"""What the planner cannot know, fitted on published runs and checked on runs it was not
fitted to.

    rows = leave_one_out()            # every run predicted from the others
    predict_range(shape, cluster, plan, exclude="torchtitan-h100-8b-fsdp-8gpu")

The planner knows FLOPs, bytes and links. It cannot know how fast PyTorch's GEMMs
really run on a GPU inside a whole training step, eager or compiled (launch gaps,
FSDP2's hooks, power caps, the shapes of the day): that is one number per GPU kind
(``hardware.GPU.kind``), the achieved GEMM efficiency. For each published run we solve
for the efficiency that makes the planner give the run's own tokens/s
(``implied_efficiency``); a run is then predicted with the efficiencies implied by the
*other* runs of its GPU kind, as a range from the lowest to the highest, around their
median. Memory has one unknown too, what the allocator reserves beyond what is live and
what the model does not count: the published-over-predicted ratio of the other runs
that report memory, as a range the same way.
"""

from __future__ import annotations

import functools
import statistics

from distlab.planner.hardware import GPUS
from distlab.planner.predict import Plan, gpu_cluster, memory, predict
from distlab.planner.runs import RUNS, RUNS_BY_NAME, SOURCES
from distlab.planner.shapes import ModelShape

# runs that state no interconnect (torchtitan's 64 A100s): the 8-GPU HGX node with a
# 200 Gb/s HDR NIC per GPU, an assumption the page varies
ASSUMED_NETWORK, ASSUMED_GPUS_PER_NODE = "ib-200g", 8
GiB = 2**30


def modelled(run: dict) -> str | None:
    """Why the planner cannot predict this run's speed, or None: it has no model of
    Float8 matmuls."""
    return "Float8 matmuls are not modelled" if run["plan"].get("float8") else None


def shape_of(run: dict) -> ModelShape:
    """The run's model as the planner's shape."""
    m = run["model"]
    return ModelShape(
        run["name"],
        run["title"],
        m["n_layer"],
        m["d_model"],
        m["n_head"],
        m["n_kv_head"],
        m["ffn_hidden"],
        m["vocab_size"],
        m["seq_len"],
        "gpt2" if m["ffn_kind"] == "gelu" else "llama",
        m["model_source"],
    )


def inputs(run: dict, network: str | None = None) -> tuple[ModelShape, object, Plan]:
    """The run as the planner's inputs: its model, its cluster (the assumed network
    where it states none), and its plan. A ZeRO-1 or ZeRO-2 run keeps bf16 parameters
    and gradients (llm.c, DeepSpeed): its state and reduction are bf16."""
    p, gpus = run["plan"], run["gpus"]
    per_node = run.get("gpus_per_node") or ASSUMED_GPUS_PER_NODE
    net = network or run["network"] or ASSUMED_NETWORK
    cluster = gpu_cluster(run["gpu"], gpus, per_node, net if gpus > per_node else None)
    bf16_state = p["strategy"] in ("zero1", "zero2")
    plan = Plan(
        p["strategy"],
        p["micro_batch"],
        run["model"]["seq_len"],
        p["accum_steps"],
        p["ac"]["mode"],
        p["ac"].get("frequency", 2),
        "bf16",
        2 if bf16_state else 4,
        group=p.get("shard_group") if p["strategy"] == "hsdp" else None,
        state="bf16_mixed" if bf16_state else "fp32",
    )
    return shape_of(run), cluster, plan


def implied_efficiency(run: dict) -> float:
    """The GEMM efficiency (fraction of the bf16 peak) at which the planner gives the
    run's published tokens/s per GPU: bisection, the prediction rising with it."""
    return _implied(run["name"])


@functools.cache
def _implied(name: str) -> float:
    run = RUNS_BY_NAME[name]
    shape, cluster, plan = inputs(run)
    target = run["published"]["tokens_per_s_per_gpu"]
    lo, hi = 0.01, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if predict(shape, cluster, plan, mid)["tokens_per_s_per_gpu"] < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def memory_ratio(run: dict) -> float | None:
    """Published memory per GPU over the planner's, where the run reports it."""
    return _memory_ratio(run["name"])


@functools.cache
def _memory_ratio(name: str) -> float | None:
    run = RUNS_BY_NAME[name]
    published = run["published"].get("memory_bytes_per_gpu")
    if not published:
        return None
    return published / predict(*inputs(run))["memory"]["total"]


def _names(exclude) -> frozenset[str]:
    """``exclude`` as a set of run names: None, one name, or several."""
    if exclude is None:
        return frozenset()
    names = frozenset([exclude] if isinstance(exclude, str) else exclude)
    for name in names:
        run_named(name)  # a typo is an error, not a silent full calibration
    return names


def kind(gpu: str) -> str:
    """The GPU's kind: GPUs of one kind compute alike (``GPU.kind``)."""
    return GPUS[gpu].kind or gpu


def calibration_runs(gpu: str, exclude=None) -> list[dict]:
    """The runs whose speed calibrates ``gpu``: modelled, on a GPU of its kind."""
    left_out = _names(exclude)
    return [
        r
        for r in RUNS
        if kind(r["gpu"]) == kind(gpu) and not modelled(r) and r["name"] not in left_out
    ]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(lowest, median, highest)."""
    return min(values), statistics.median(values), max(values)


def calibration(gpu: str, exclude=None) -> dict:
    """What the published runs say of ``gpu``: the GEMM efficiencies the runs of that
    kind imply, and the published-over-predicted memory of every run that reports
    memory, each as (lowest, median, highest). ``exclude``: a run (or runs) left out of
    both."""
    left_out = _names(exclude)
    runs = calibration_runs(gpu, left_out)
    if len(runs) < 2:
        raise ValueError(
            f"{len(runs)} published run(s) calibrate {kind(gpu)}: a range needs at "
            "least 2"
        )
    ratios = [
        m
        for r in RUNS
        if r["name"] not in left_out and (m := memory_ratio(r)) is not None
    ]
    return {
        "efficiency": spread([implied_efficiency(r) for r in runs]),
        "calibrated_on": [r["name"] for r in runs],
        # None where no other run reports memory
        "memory_ratio": spread(ratios) if ratios else None,
        "memory_runs": len(ratios),
    }


def gpu_of(cluster) -> str:
    """The key of the cluster's GPU in ``distlab.planner.hardware.GPUS``."""
    return next(k for k, g in GPUS.items() if g.label == cluster.device.name)


def predict_range(
    shape: ModelShape,
    cluster,
    plan: Plan,
    exclude=None,
    timed: bool = True,
) -> dict:
    """tokens/s per GPU and memory per GPU as (low, middle, high): the planner at the
    efficiencies the calibration runs of this GPU kind imply, and its memory times the
    ratios of the runs that report memory (``calibration``). ``timed`` False: the
    memory range only."""
    c = calibration(gpu_of(cluster), exclude)
    tps = (
        tuple(
            predict(shape, cluster, plan, e)["tokens_per_s_per_gpu"]
            for e in c["efficiency"]
        )
        if timed
        else None
    )
    mem = memory(shape, cluster, plan)["total"]
    return {
        **c,
        "tokens_per_s_per_gpu": tps,
        "memory": tuple(mem * x for x in c["memory_ratio"])
        if c["memory_ratio"]
        else None,
    }


def leave_one_out(by: str = "run") -> list[dict]:
    """Every run predicted from the others (``by="run"``), or from the other sources
    only (``by="source"``: a source's runs share a code base and a cluster, so this
    is the harder test): its range, the error of the middle, and whether the
    published figure lies inside the range."""
    if by not in ("run", "source"):
        raise ValueError(f"leave out by 'run' or 'source', not {by!r}")
    source_of = {r["name"]: s for s, runs in SOURCES.items() for r in runs}
    rows = []
    for run in RUNS:
        left_out = (
            [r["name"] for r in SOURCES[source_of[run["name"]]]]
            if by == "source"
            else run["name"]
        )
        shape, cluster, plan = inputs(run)
        published = run["published"]
        row = {
            "run": run["name"],
            "source": source_of[run["name"]],
            "url": run["source"],
            "gpu": run["gpu"],
            "gpus": run["gpus"],
            "published": published["tokens_per_s_per_gpu"],
            "published_memory": published.get("memory_bytes_per_gpu"),
            "why_not": modelled(run),
        }
        if row["why_not"] is None:
            row["implied_efficiency"] = implied_efficiency(run)
        try:
            r = predict_range(shape, cluster, plan, exclude=left_out)
        except ValueError as e:
            row["why_not"] = row["why_not"] or str(e)
            r = None
        if r is not None and r["memory"] is not None:
            lo, mid, hi = r["memory"]
            row.update(memory=r["memory"])
            if row["published_memory"]:
                row["memory_error"] = mid / row["published_memory"] - 1
                row["memory_inside"] = lo <= row["published_memory"] <= hi
        if r is not None:
            if modelled(run) is None:
                lo, mid, hi = r["tokens_per_s_per_gpu"]
                row.update(
                    predicted=r["tokens_per_s_per_gpu"],
                    error=mid / row["published"] - 1,
                    inside=lo <= row["published"] <= hi,
                    efficiency=r["efficiency"],
                )
        rows.append(row)
    return rows


def run_named(name: str) -> dict:
    if name not in RUNS_BY_NAME:
        raise ValueError(
            f"unknown run {name!r}; choose one of {', '.join(RUNS_BY_NAME)}"
        )
    return RUNS_BY_NAME[name]
