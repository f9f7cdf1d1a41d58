"""Pictures and tables of FSDP2 drawn from real runs (``book/fsdp2.md``).

    unit_timeline(spans)      # one lane per unit: all-gather, held whole, compute,
                              # reduce-scatter, from FSDP2's own profiler ranges
    shard_figure(tables)      # the rows of each parameter each rank holds (DTensor)
    op_dtype_rows(ops)        # the dtype each op of a step ran in, by phase
    bench_rows(benches)       # the recorded DDP / FSDP2 benchmark, row by row
    takeaways(benches)        # three rows: what FSDP2, no reshard and bf16 change

``spans`` are ``(name, start_ms, end_ms)`` from ``step_trace`` (run on every rank);
``tables`` are ``chapters.fsdp2.shard_table`` of each rank.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from distlab.data import token_data
from distlab.model import GPT, preset
from distlab.parallel import apply_fsdp
from distlab.runtime import dist_env, pick_device, rank_world


def step_trace(
    n_layer: int = 4, reshard_after_forward: bool = True, rows: int = 4
) -> list:
    """One step of ``apply_fsdp`` on the tiny GPT with ``n_layer`` blocks, under the
    profiler (after a warm-up step): FSDP2's ranges and the backend's collectives,
    ``(name, start, end)`` in ms from the step's start."""
    from torch.profiler import ProfilerActivity, profile

    device = pick_device("auto", dist_env()[1])
    cfg = preset("tiny", n_layer=n_layer, vocab_size=token_data().vocab_size)
    model = apply_fsdp(GPT(cfg, seed=0).to(device), None, reshard_after_forward)
    rank, world = rank_world()
    x, y = token_data().batch("train", 0, rows * world, 64, 0, rank, world, device)
    model(x, y)[1].backward()  # warm-up: FSDP2 builds its lazy state
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x, y)[1].backward()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start
    return [
        (e.name, (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3)
        for e in events
        if e.name.startswith(("FSDP::", "gloo:", "nccl:"))
    ]


def most_held(spans: list) -> int:
    """The most units held whole at one moment of the step."""
    held = [
        (s, e)
        for bars in unit_bars(spans).values()
        for k, s, e in bars
        if k == "held whole"
    ]
    return max(sum(s <= t < e for s, e in held) for t, _ in held)


COLORS = {
    "held whole": "#c7dcef",
    "all-gather": "#1f77b4",
    "forward": "#2ca02c",
    "backward": "#ff7f0e",
    "reduce-scatter": "#d62728",
}


def _unit(name: str) -> str:
    """``FSDP::all_gather (blocks.0)`` -> ``blocks.0``; no unit named: the root."""
    inside = name[name.index("(") + 1 : -1] if "(" in name else ""
    return inside or "root"


def unit_bars(spans: list) -> dict[str, list[tuple[str, float, float]]]:
    """{unit: [(kind, start, end)]} from FSDP2's ranges (kinds: ``COLORS``).

    A unit is held whole from the end of each all-gather to its next reshard: the
    post-backward reshard, or its post-forward when it is gathered again later (then
    the post-forward freed it)."""
    bars: dict[str, list] = {}
    opened: dict[str, float] = {}
    gathered: dict[str, float] = {}
    ags = [
        (_unit(n), s, e)
        for n, s, e in spans
        if n.startswith("FSDP::all_gather") and "copy_out" not in n
    ]
    for name, start, end in spans:
        u = _unit(name)
        add = bars.setdefault(u, []).append
        if name.startswith("FSDP::all_gather") and "copy_out" not in name:
            add(("all-gather", start, end))
            gathered[u] = end
        elif name.startswith(("FSDP::pre_forward (", "FSDP::pre_backward (")):
            opened[u] = end
        elif name.startswith("FSDP::post_forward ("):
            if u in opened:
                add(("forward", opened.pop(u), start))
            again = any(g == u and s > end for g, s, _ in ags)
            if again and u in gathered:
                add(("held whole", gathered.pop(u), end))
        elif name.startswith("FSDP::post_backward_accumulate (") and u in opened:
            add(("backward", opened.pop(u), start))
        elif name.startswith("FSDP::post_backward_reshard") and u in gathered:
            add(("held whole", gathered.pop(u), end))
        elif name.startswith("FSDP::post_backward_reduce"):
            add(("reduce-scatter", start, end))
    return bars


def unit_timeline(spans: list, title: str = ""):
    """One lane per FSDP2 unit (root on top): when it is all-gathered, held whole,
    computes, and reduce-scattered, in ms since the step began."""
    bars = unit_bars(spans)
    units = ["root"] + sorted(u for u in bars if u != "root")
    # 6.4 in wide, fonts of 15 pt and more: readable at a phone's 360 px
    fig, ax = plt.subplots(figsize=(6.4, 0.7 * len(units) + 2.6))
    for y, u in enumerate(reversed(units)):
        for kind, start, end in bars.get(u, []):
            held = kind == "held whole"
            ax.barh(
                y,
                end - start,
                left=start,
                height=0.8 if held else 0.45,
                color=COLORS[kind],
                zorder=1 if held else 2,
            )
    labels = [u.replace("blocks.", "block ") for u in units][::-1]
    ax.set_yticks(range(len(units)), labels, fontsize=16)
    ax.tick_params(axis="x", labelsize=15)
    ax.set_xlabel("ms into the step (rank 0)", fontsize=16)
    ax.spines[["top", "right"]].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(
        handles,
        list(COLORS),
        ncol=2,
        fontsize=15,
        loc="lower center",
        frameon=False,
        handlelength=1.2,
        columnspacing=1.0,
    )
    if title:
        ax.set_title(title, fontsize=16)
    fig.tight_layout(rect=(0, 0.27, 1, 1))
    return fig


def shard_figure(tables: list[list[dict]], names: tuple[str, ...]):
    """For each parameter in ``names``: its rows (dim 0), coloured by the rank that
    holds them, read from each rank's ``to_local()`` shape."""
    fig, ax = plt.subplots(figsize=(6.4, 0.6 * len(names) + 1.6))
    shades = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    for y, name in enumerate(reversed(names)):
        left = 0
        for rank, table in enumerate(tables):
            row = next(r for r in table if r["name"] == name)
            held = row["local"][0]
            ax.barh(y, held, left=left, color=shades[rank % 4], edgecolor="white")
            ax.text(
                left + held / 2,
                y,
                str(held),
                ha="center",
                va="center",
                color="white",
                fontsize=15,
            )
            left += held
    short = [n.replace("blocks.0.", "b0.") for n in reversed(names)]
    ax.set_yticks(range(len(names)), short, fontsize=15)
    ax.set_xlabel("rows (dim 0) each rank holds", fontsize=16)
    ax.tick_params(axis="x", labelsize=14)
    handles = [plt.Rectangle((0, 0), 1, 1, color=shades[r]) for r in range(len(tables))]
    ax.legend(
        handles,
        [f"rank {r}" for r in range(len(tables))],
        loc="lower right",
        fontsize=15,
    )
    fig.tight_layout()
    return fig


# (phase, operator, what it is in our step)
STEP_OPS = [
    ("forward", "c10d._allgather_base_", "all-gather of a unit"),
    ("forward", "aten.embedding", "embeddings"),
    ("forward", "aten.add", "residual adds"),
    ("forward", "aten.native_layer_norm", "LayerNorm"),
    ("forward", "aten.addmm", "Linear layers"),
    ("forward", "attention", "attention"),
    ("forward", "aten.gelu", "GELU"),
    ("forward", "aten.mm", "head (tied)"),
    ("forward", "aten._log_softmax", "cross-entropy"),
    ("backward", "aten.mm", "matmul gradients"),
    ("backward", "aten.native_layer_norm_backward", "LayerNorm"),
    ("backward", "attention", "attention"),
    ("backward", "aten.add", "residual stream"),
    ("backward", "fsdp.chunk_cat", "copy into RS buffer"),
    ("backward", "c10d._reduce_scatter_base_", "reduce-scatter"),
    ("optimizer", "aten._fused_adamw_", "AdamW"),
]


def _ran_as(rows: list[dict], phase: str, op: str) -> str:
    """The distinct dtypes an op ran with ("in -> out"), int64-only calls left out."""

    def match(name: str) -> bool:
        if op == "attention":  # the kernel's name depends on the device and build
            backward = name.endswith("_backward")
            return name.startswith("aten._scaled_dot_product") and backward == (
                phase == "backward"
            )
        return name == op

    found = [
        r["dtypes"]
        for r in rows
        if r["phase"] == phase
        and match(r["op"])
        and r["dtypes"].replace("int64", "").strip(" ,->")
    ]
    return "; ".join(found) or "none"


def op_dtype_rows(ops: dict[str, list[dict]]) -> list[dict]:
    """``STEP_OPS`` with the dtypes each ran in under the policy and autocast."""
    return [
        {
            "phase": phase,
            "op": what,
            "FSDP2 policy": _ran_as(ops["policy"], phase, op),
            "autocast": _ran_as(ops["autocast"], phase, op),
        }
        for phase, op, what in STEP_OPS
    ]


def verdict(a: dict, b: dict) -> str:
    """Row a's tokens/s against row b's: a direction only when the spreads (min to
    max of the repeats) do not overlap."""
    if a["min"] > b["max"]:
        return "faster"
    if a["max"] < b["min"]:
        return "slower"
    return "within spread"


def bench_rows(benches: dict[int, dict]) -> list[dict]:
    """Every recorded run: batch, strategy, ranks, tokens/s (median, spread), model
    state and peak per rank. 4 ranks on a 2-core machine are marked oversubscribed."""
    rows = []
    for batch, bench in benches.items():
        cores = bench["provenance"]["cpu_count"]
        for r in bench["runs"]:
            speed, n = r["tokens_per_s"], r["world_size"]
            rows.append(
                {
                    "batch": batch,
                    "strategy": r["strategy"],
                    "ranks": f"{n}*" if n > cores else n,
                    "tok/s": speed["median"],
                    "spread": f"{speed['min']:,.0f}-{speed['max']:,.0f}",
                    "state MB": max(s["total"] for s in r["state_per_rank"]) / 1e6,
                    "peak MB": max(p["Total"] for p in r["peak_per_rank"]) / 1e6,
                }
            )
    return rows


def _run(bench: dict, strategy: str, ranks: int = 2) -> dict:
    return next(
        r
        for r in bench["runs"]
        if r["strategy"] == strategy and r["world_size"] == ranks
    )


def _state(r: dict) -> int:
    return max(s["total"] for s in r["state_per_rank"])


def _peak(r: dict) -> int:
    return max(p["Total"] for p in r["peak_per_rank"])


def takeaways(bench: dict) -> list[dict]:
    """Three comparisons at 2 ranks of one recorded benchmark: model state, peak and
    tokens/s of the second run over the first, the speed with its verdict."""
    rows = []
    for change, base, other in (
        ("FSDP2 / DDP", "ddp", "fsdp2"),
        ("no reshard / FSDP2", "fsdp2", "fsdp2-no-reshard"),
        ("bf16 policy / fp32", "fsdp2", "fsdp2-bf16"),
    ):
        a, b = _run(bench, other), _run(bench, base)
        ta, tb = a["tokens_per_s"], b["tokens_per_s"]
        rows.append(
            {
                "change": change,
                "state": f"{_state(a) / _state(b):.2f}x",
                "peak": f"{_peak(a) / _peak(b):.2f}x",
                "tokens/s": f"{ta['median'] / tb['median']:.2f}x ({verdict(ta, tb)})",
            }
        )
    return rows
