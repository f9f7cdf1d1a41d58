"""Which plan to run: every plan that fits, ranked by the tokens/s the planner predicts,
and why the winner wins.

    ranked = recommend(
        shape("llama3-8b"),
        gpu_cluster("h100-sxm", 64, network="ib-400g"),
        seq_len=8192,
        global_batch=512,
    )
    print(explain(ranked))

A plan is a strategy, an activation-checkpointing mode and a micro-batch; the
accumulation follows from the global batch (sequences per optimizer step, the same
whatever the plan: it is a training choice, not a systems one). The strategies are the
rows of ``distlab.costs.strategies``; hybrid sharding shards within a node and
replicates across nodes.
"""

from __future__ import annotations

from distlab.costs.strategies import STRATEGIES as ROWS
from distlab.planner.predict import (
    AC_MODES,
    FIT_FRACTION,
    STRATEGIES,
    Cluster,
    Plan,
    predict,
)
from distlab.planner.shapes import ModelShape

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def candidate_plans(
    cluster: Cluster, seq_len: int, global_batch: int, precision: str = "bf16"
) -> list[Plan]:
    """Every plan whose micro-batch times the ranks divides the global batch."""
    if global_batch < 1 or global_batch % cluster.gpus:
        raise ValueError(
            f"the global batch ({global_batch} sequences) must be a multiple of "
            f"the {cluster.gpus} GPUs"
        )
    plans = []
    for strategy in STRATEGIES:
        by_group = ROWS[strategy].shards_over == "group"
        if by_group and cluster.gpus <= cluster.gpus_per_node:
            continue  # one node: hybrid sharding is plain FSDP2
        for ac in AC_MODES:
            for micro in MICRO_BATCHES:
                if (global_batch // cluster.gpus) % micro:
                    continue
                accum = global_batch // (cluster.gpus * micro)
                group = cluster.gpus_per_node if by_group else None
                # sharded gradients: reduce each micro-batch's (memory stays sharded) or
                # only the last's
                sharded = ROWS[strategy].gathered is not None
                syncing = (False, True) if sharded and accum > 1 else (False,)
                for sync in syncing:
                    plans.append(
                        Plan(
                            strategy,
                            micro,
                            seq_len,
                            accum,
                            ac,
                            precision=precision,
                            group=group,
                            sync_every_micro_batch=sync,
                        )
                    )
    return plans


def recommend(
    shape: ModelShape,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    precision: str = "bf16",
    efficiency: float | None = None,
    memory_ratio: float = 1.0,
) -> list[tuple[Plan, dict]]:
    """The plans that fit, fastest first: each predicted at ``efficiency`` (the
    calibrated GEMM efficiency, ``distlab.planner.calibrate``), fitting when its memory
    times ``memory_ratio`` (the calibration's published over predicted) is at most
    FIT_FRACTION of the GPU's. The planner counts no cost per kernel launch, so plans
    it predicts equally fast (to 6 digits) are ordered larger micro-batch first: fewer,
    larger kernels."""
    predicted = [
        (plan, predict(shape, cluster, plan, efficiency))
        for plan in candidate_plans(cluster, seq_len, global_batch, precision)
    ]
    limit = FIT_FRACTION * cluster.device.memory_bytes
    fitting = [
        (plan, p)
        for plan, p in predicted
        if p["memory"]["total"] * memory_ratio <= limit
    ]
    speed = lambda p: float(f"{p['tokens_per_s_per_gpu']:.6g}")  # noqa: E731
    return sorted(
        fitting,
        key=lambda pair: (
            -speed(pair[1]),
            -pair[0].micro_batch,
            pair[1]["memory"]["total"],
        ),
    )


def describe(plan: Plan) -> str:
    group = f" (groups of {plan.group})" if plan.group else ""
    sync = ", reducing every micro-batch" if plan.sync_every_micro_batch else ""
    return (
        f"{plan.strategy}{group}, AC {plan.ac}, micro-batch {plan.micro_batch} x "
        f"{plan.accum} accumulated{sync}"
    )


def explain(ranked: list[tuple[Plan, dict]], top: int = 5) -> str:
    """The ranking as lines, then why the first beats the second: what each exposes
    and recomputes."""
    if not ranked:
        return "no plan fits: more GPUs, a shorter sequence, or a smaller model"
    lines = []
    for plan, p in ranked[:top]:
        t, gb = p["time"], p["memory"]["total"] / 1e9
        lines.append(
            f"{p['tokens_per_s_per_gpu']:10,.0f} tok/s/GPU  MFU {p['mfu']:5.1%} "
            f" {gb:6.1f} GB  "
            f"exposed {t['exposed'] / t['step']:4.0%}  recompute "
            f"{t['recompute'] / t['step']:4.0%}  {describe(plan)}"
        )
    if len(ranked) > 1:
        (_, pa), (b, pb) = ranked[0], ranked[1]
        ta, tb = pa["time"], pb["time"]
        lines.append(
            f"why: per step, the first exposes {ta['exposed']:.3g} s of "
            f"communication against {tb['exposed']:.3g} s, "
            f"recomputes {ta['recompute']:.3g} s against {tb['recompute']:.3g} "
            f"s, and computes {ta['compute']:.3g} s "
            f"against {tb['compute']:.3g} s ({describe(b)})"
        )
    return "\n".join(lines)
