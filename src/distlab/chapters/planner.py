"""The planner chapter's experiments: the planner's predictions against published runs,
how they move with the network no publication states, and the
predicted-against-measured picture.

Nothing here runs ranks: the planner is arithmetic, and what it is checked against is
recorded (``results/``) or published (``distlab.tools.published_runs``, each with
its source).
"""

from __future__ import annotations

import dataclasses
import json

from distlab.tools.memory_calculator import per_rank_bytes
from distlab.tools.planner import (
    OPTIMIZER,
    ZERO_STAGE,
    Plan,
    gpu_cluster,
    memory,
    predict,
)
from distlab.tools.planner_check import INPUTS, RECORDED, check_recorded
from distlab.tools.published_runs import PUBLISHED_RUNS
from distlab.tools.published_runs_h100 import H100_RUNS
from distlab.tools.shapes import SHAPES, ModelShape

# The assumption for runs that do not state their interconnect (torchtitan's 64 A100s):
# the 8-GPU HGX A100 node with one 200 Gb/s HDR InfiniBand NIC per GPU. The page shows
# how the prediction moves if it is wrong (``network_sweep``).
ASSUMED_NETWORK, ASSUMED_GPUS_PER_NODE = "ib-200g", 8
TARGET = 0.20  # the target on tokens/s per GPU
MEMORY_TARGET = 0.10  # and on memory per GPU, where a publication gives it
# torchtitan's H100 rows that run what the planner models, eager bf16: no torch.compile,
# no Float8
EAGER_H100 = [
    run for run in H100_RUNS if not run["plan"]["compile"] and not run["plan"]["float8"]
]
CHECKED_RUNS = PUBLISHED_RUNS + EAGER_H100


def shape_of(run: dict) -> ModelShape:
    """The planner's shape whose sizes are the run's (checked field by field, not
    by name)."""
    m = run["model"]
    fields = ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_hidden", "vocab_size")
    for s in SHAPES.values():
        if all(getattr(s, f) == m[f] for f in fields) and s.family == (
            "gpt2" if m["ffn_kind"] == "gelu" else "llama"
        ):
            return s
    raise ValueError(f"no shape in distlab.tools.shapes has the sizes of {run['name']}")


def setup(run: dict, network: str | None = None) -> tuple[ModelShape, object, Plan]:
    """The run as the planner's inputs: its model, its cluster (the assumed network
    where it states none), and its plan (the ZeRO-1 of llm.c keeps bf16 parameters and
    gradients: its state and reduction are bf16)."""
    p, gpus = run["plan"], run["gpus"]
    per_node = run.get("gpus_per_node") or ASSUMED_GPUS_PER_NODE
    net = network or run["network"] or ASSUMED_NETWORK
    cluster = gpu_cluster(run["gpu"], gpus, per_node, net if gpus > per_node else None)
    bf16_state = p["strategy"] == "zero1"
    ac = p["ac"]["mode"]
    plan = Plan(
        p["strategy"],
        p["micro_batch"],
        run["model"]["seq_len"],
        p["accum_steps"],
        ac,
        p["ac"].get("frequency", 2),
        "bf16",
        2 if bf16_state else 4,
        state="bf16_mixed" if bf16_state else "fp32",
    )
    return shape_of(run), cluster, plan


def published_rows() -> list[dict]:
    """Prediction against publication for every run, with the error and what
    was assumed."""
    rows = []
    for run in CHECKED_RUNS:
        shape, cluster, plan = setup(run)
        p = predict(shape, cluster, plan)
        published = run["published"]["tokens_per_s_per_gpu"]
        error = p["tokens_per_s_per_gpu"] / published - 1
        t = p["time"]
        rows.append(
            {
                "run": run["name"],
                "title": run["title"],
                "source": run["source"],
                "gpu": run["gpu"],
                "network": run["network"] or f"{ASSUMED_NETWORK} (assumed)",
                "published": published,
                "predicted": p["tokens_per_s_per_gpu"],
                "error": error,
                "within": abs(error) <= TARGET,
                "published_mfu": run["published"]["mfu"],
                "mfu": p["mfu"],
                "memory": p["memory"]["total"],
                "exposed": t["exposed"] / t["step"],
                "step": t["step"],
                "recompute": t["recompute"] / t["step"],
                "memory-bound": t["memory-bound"] / t["step"],
            }
        )
    return rows


def network_sweep(gbits=(50, 100, 200, 400, 800)) -> dict[str, list[float]]:
    """Predicted tokens/s per GPU of the runs that state no network, for each per-GPU
    network bandwidth (Gb/s, one NIC per GPU): how much the one unstated input moves
    the prediction."""
    out = {}
    for run in PUBLISHED_RUNS:
        if run["network"]:
            continue
        shape, cluster, plan = setup(run)
        out[run["name"]] = [
            predict(
                shape,
                dataclasses.replace(
                    cluster, inter=dataclasses.replace(cluster.inter, busbw=g * 1e9 / 8)
                ),
                plan,
            )["tokens_per_s_per_gpu"]
            for g in gbits
        ]
    return {"gbits": list(gbits), "runs": out}


def sweep_figure(sweep: dict):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(7, 3.6))
    published = {
        r["name"]: r["published"]["tokens_per_s_per_gpu"] for r in PUBLISHED_RUNS
    }
    for (name, values), color in zip(
        sweep["runs"].items(), ("#3b6ea5", "#7a9e5a", "#c0504d")
    ):
        ax.plot(sweep["gbits"], values, "o-", color=color, label=f"{name}: predicted")
        ax.axhline(published[name], color=color, ls="--", lw=1)
    ax.axvline(200, color="#888", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="network per GPU (Gb/s, one direction)",
        ylabel="tokens/s per GPU",
    )
    ax.xaxis.set_minor_locator(NullLocator())  # only the swept bandwidths are labelled
    ax.set_xticks(sweep["gbits"], [str(g) for g in sweep["gbits"]])
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(
        "dashed: published; grey line: the assumed 200 Gb/s HDR NIC per GPU", fontsize=9
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def prediction_figure(published: list[dict], measured: list[dict]):
    """Predicted against measured (or published) tokens/s, with the 20% band: one point
    per run."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    a100 = [r for r in published if r["gpu"].startswith("a100")]
    h100 = [r for r in published if r["gpu"].startswith("h100")]
    for rows, key, style, label in (
        (
            measured,
            "measured",
            {"color": "#e39b4c", "marker": "o"},
            "this CPU: labs 1-5 on 1, 2, 4 ranks",
        ),
        (
            a100,
            "published",
            {"color": "#3b6ea5", "marker": "s"},
            "published runs on A100s",
        ),
        (
            h100,
            "published",
            {"color": "#c0504d", "marker": "^"},
            "published runs on H100s",
        ),
    ):
        ax.scatter(
            [r[key] for r in rows],
            [r["predicted"] for r in rows],
            label=label,
            zorder=3,
            **style,
        )
    lo, hi = 2e2, 5e5
    ax.plot([lo, hi], [lo, hi], color="#333", lw=1)
    ax.fill_between(
        [lo, hi],
        [lo * (1 - TARGET), hi * (1 - TARGET)],
        [lo * (1 + TARGET), hi * (1 + TARGET)],
        color="#999",
        alpha=0.25,
        label="within 20%",
    )
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    ax.set(
        xlabel="measured or published tokens/s (per GPU; per machine on the CPU)",
        ylabel="predicted tokens/s",
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def memory_rows() -> list[dict]:
    """Bytes per GPU the planner predicts against those a publication prints: llm.c's
    GPT-2 1.5B log lists the buffers it allocates (llm.c allocates everything before the
    first step, so these are what it holds)."""
    rows = []
    for run in PUBLISHED_RUNS:
        printed = run["published"].get("allocations_mib")
        if not printed:
            continue
        shape, cluster, plan = setup(run)
        # llm.c's buffers are the model state and the activations: the state as the ZeRO
        # paper counts it (no DDP buckets: llm.c accumulates into its one gradient
        # buffer), the activations at their peak
        state = per_rank_bytes(
            shape.n_params(),
            cluster.gpus,
            plan.state,
            OPTIMIZER,
            ZERO_STAGE[plan.strategy],
        )
        pairs = {
            "parameters": (printed["params"], state["params"]),
            "gradients": (printed["grads"], state["grads"]),
            "AdamW moments and master weights": (
                printed["adam_m"] + printed["adam_v"] + printed["master"],
                state["optimizer"],
            ),
            "activations": (
                printed["activations"],
                memory(shape, cluster, plan)["activations"],
            ),
        }
        pairs["total"] = (
            sum(p for p, _ in pairs.values()),
            sum(q for _, q in pairs.values()),
        )
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
    (``distlab.tools.planner_check``): at the matmul peak the runs timed, and at the
    rate a rank sustains; attention at the rate SDPA's CPU kernel was timed at, as a
    GPU's is at FlashAttention's."""
    inputs, recorded = (json.loads(path.read_text()) for path in (INPUTS, RECORDED))
    at_peak = check_recorded(inputs, recorded, "peak", "measured")
    sustained = check_recorded(inputs, recorded, "sustained", "measured")
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
                "predicted_sustained": s["tokens_per_s"]["predicted"],
                "error_sustained": s["tokens_per_s"]["error_pct"] / 100,
                "peak_measured": p["measured"],
                "peak_predicted": p["predicted"],
                "peak_error": p["error_pct"] / 100,
                "state_error": r["state_bytes"]["error_pct"] / 100,
            }
        )
    return rows


def implied_matmul_efficiency(run: dict) -> float:
    """The GEMM efficiency that would make the planner's tokens/s equal the published
    figure, every other input as it is (bisected: tokens/s grows with the efficiency).
    """
    shape, cluster, plan = setup(run)
    published = run["published"]["tokens_per_s_per_gpu"]
    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        device = dataclasses.replace(cluster.device, matmul_efficiency=mid)
        tokens_per_s = predict(
            shape, dataclasses.replace(cluster, device=device), plan
        )["tokens_per_s_per_gpu"]
        lo, hi = (mid, hi) if tokens_per_s < published else (lo, mid)
    return lo


def published_memory_rows() -> list[dict]:
    """The planner's peak bytes per GPU against the memory a publication prints for the
    same run (torchtitan's H100 tables: most likely the caching allocator's reserved
    peak, the largest over the GPUs; the planner counts tensors, nearer the allocated
    peak, which is at most that)."""
    rows = []
    for run in CHECKED_RUNS:
        published = run["published"].get("memory_bytes_per_gpu")
        if published:
            shape, cluster, plan = setup(run)
            predicted = predict(shape, cluster, plan)["memory"]["total"]
            kind = run["published"].get("memory_kind", "")
            rows.append(
                {
                    "run": run["name"],
                    "published": published,
                    "predicted": predicted,
                    "error": predicted / published - 1,
                    "kind": kind,
                }
            )
    return rows
