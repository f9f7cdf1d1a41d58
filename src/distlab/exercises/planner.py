"""Checker of the planner chapter's exercise that asks for code: a plan for Llama 3 70B
on 128 H100s."""

from __future__ import annotations

from distlab.planner.predict import Plan, gpu_cluster, predict
from distlab.planner.recommend import recommend
from distlab.planner.shapes import shape

# the run the exercise plans: 16 nodes of 8 H100s, 400 Gb/s per GPU, 256 sequences of
# 8192 tokens per step
GPUS, NETWORK, SEQ_LEN, GLOBAL_BATCH = 128, "ib-400g", 8192, 256


def check_70b_plan(make_plan) -> None:
    """``make_plan()`` returns a ``Plan``. It passes if the plan fits, keeps the global
    batch, and reaches at least 95% of the best tokens/s the recommender finds among the
    plans that fit."""
    model, cluster = shape("llama3-70b"), gpu_cluster("h100-sxm", GPUS, 8, NETWORK)
    plan = make_plan()
    if not isinstance(plan, Plan):
        raise ValueError(
            "make_plan() must return a distlab.planner.predict.Plan, got "
            f"{type(plan).__name__}"
        )
    assert plan.seq_len == SEQ_LEN, (
        f"the run trains on sequences of {SEQ_LEN} tokens, the plan has {plan.seq_len}"
    )
    batch = plan.micro_batch * plan.accum * GPUS
    assert batch == GLOBAL_BATCH, (
        f"the plan's global batch is {batch} sequences, the run's is {GLOBAL_BATCH}"
    )
    p = predict(model, cluster, plan)
    m = p["memory"]
    assert m["fits"], (
        f"the plan needs {m['total'] / 1e9:.1f} GB per GPU, more than 90% of "
        "the H100's 80 GB"
    )
    best = recommend(model, cluster, SEQ_LEN, GLOBAL_BATCH)[0][1][
        "tokens_per_s_per_gpu"
    ]
    got = p["tokens_per_s_per_gpu"]
    assert got >= 0.95 * best, (
        f"{got:,.0f} tokens/s per GPU: the best plan that fits reaches {best:,.0f}"
    )
    # two lines: the page prints this, in an 88-column code block
    print(f"passed: the plan fits ({m['total'] / 1e9:.1f} GB per GPU) and reaches")
    print(
        f"{got:,.0f} tokens/s per GPU at the GPU's MAMF efficiency, "
        f"{got / best:.0%} of the best plan"
    )
