"""What a benchmark recording says that transfers to another machine: the bytes each
rank holds and the bytes it sends per step, per strategy; and the speed ratios with the
range their repeats allow, a verdict worded only where the ranges do not overlap.

    result = recorded_results()["cpu_shakespeare_fp32"]   # distlab.bench.report
    sent_bytes_per_step(run(result, "lab4_fsdp2", 2))     # from the parameter count
    bytes_figure(result)                                  # the Benchmarks key figure
    speed_rows(result)                                    # ratio, range, verdict

Held bytes are the recording's own counts (``state_bytes_per_rank``). Sent bytes are
computed from the model's parameter count and the strategy, for the ring algorithm:
an all-reduce of S bytes sends 2(N-1)/N x S from each rank, an all-gather or a
reduce-scatter (N-1)/N x S. Neither depends on the device.
"""

from __future__ import annotations

from distlab.bench.report import ratio_range
from distlab.chapters.benchmarks import LAB_NAMES, MB, run
from distlab.infra.claims import compare

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# the strategies the key figure compares: same global batch, same model
SHOWN = {"lab3_grad_accum": "DDP", "lab4_fsdp2": "FSDP2"}  # same micro-batches


# --- begin sent_bytes ---
def collectives_per_step(r: dict) -> dict[str, int]:
    """Which collectives one step of this run issues, each over all the parameters.
    DDP: one all-reduce (accumulation skips it with no_sync until the last
    micro-batch). FSDP2: an all-gather before each micro-batch's forward and again
    before its backward, one reduce-scatter after the last."""
    k = r["accum_steps"] or 1
    if r["world_size"] == 1:
        return {}
    if r["strategy"].startswith("fsdp2"):
        return {"all-gather": 2 * k, "reduce-scatter": 1}
    return {"all-reduce": 1}


def sent_bytes_per_step(r: dict) -> float:
    """Bytes one rank sends per step (ring algorithm), from the parameter count."""
    n, size = r["world_size"], r["parameters"] * DTYPE_BYTES[r["dtype"]]
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n}
    factor["reduce-scatter"] = (n - 1) / n
    return sum(c * factor[kind] * size for kind, c in collectives_per_step(r).items())
    # --- end sent_bytes ---


def bytes_rows(result: dict, labs=SHOWN, ranks=(1, 2, 4)) -> list[dict]:
    """Per strategy and rank count: model state held and bytes sent per step (MB)."""
    rows = []
    for lab in labs:
        for n in ranks:
            r = run(result, lab, n)
            if r is None or "error" in r:
                continue
            rows.append(
                {
                    "strategy": LAB_NAMES[lab],
                    "ranks": n,
                    "held MB": round(r["state_bytes_per_rank"]["total"] / MB),
                    "sent MB/step": round(sent_bytes_per_step(r) / MB),
                }
            )
    return rows


def bytes_figure(result: dict, labs=SHOWN, ranks=(1, 2, 4)):
    """Left: model state each rank holds. Right: bytes each rank sends per step."""
    import matplotlib.pyplot as plt

    # one above the other: each panel keeps the page's width on a phone
    fig, (held, sent) = plt.subplots(2, 1, figsize=(5.2, 6.4))
    width = 0.8 / len(labs)
    for i, lab in enumerate(labs):
        runs = [run(result, lab, n) for n in ranks]
        xs = [j + (i - (len(labs) - 1) / 2) * width for j in range(len(ranks))]
        name = labs[lab] if isinstance(labs, dict) else LAB_NAMES[lab]
        held.bar(xs, [r["state_bytes_per_rank"]["total"] / MB for r in runs], width)
        sent.bar(xs, [sent_bytes_per_step(r) / MB for r in runs], width, label=name)
    for ax, title in ((held, "held per rank"), (sent, "sent per rank, per step")):
        ax.set_xticks(range(len(ranks)), [str(n) for n in ranks], fontsize=13)
        ax.set_title(title, fontsize=14)
        ax.tick_params(axis="y", labelsize=12)
        ax.set_ylabel("MB", fontsize=13)
        ax.spines[["top", "right"]].set_visible(False)
    sent.set_xlabel("ranks", fontsize=13)
    sent.legend(fontsize=12, frameon=False)
    fig.tight_layout()
    return fig


# (what, faster-or-slower run, against which run)
PAIRS = [
    ("DDP, 2 ranks / lab 1", ("lab2_ddp", 2), ("lab1_single", 1)),
    ("FSDP2 / DDP, 2 ranks", ("lab4_fsdp2", 2), ("lab3_grad_accum", 2)),
    ("full AC / FSDP2, 2 ranks", ("lab5_activation_ckpt", 2), ("lab4_fsdp2", 2)),
    ("FSDP2 / DDP, 4 ranks", ("lab4_fsdp2", 4), ("lab3_grad_accum", 4)),
]
WORD = {"larger": "faster", "smaller": "slower", "within noise": "within noise"}


def speed_rows(result: dict, pairs=PAIRS) -> list[dict]:
    """Tokens/s of a over b: the median ratio, the range the repeats allow, and a
    verdict ("faster", "slower") only where the two runs' repeats do not overlap."""
    rows = []
    for what, a, b in pairs:
        ra, rb = run(result, *a), run(result, *b)
        low, high = ratio_range(ra["tokens_per_s_repeats"], rb["tokens_per_s_repeats"])
        said = compare(ra["tokens_per_s_repeats"], rb["tokens_per_s_repeats"])
        rows.append(
            {
                "tokens/s": what,
                "ratio": f"{ra['tokens_per_s'] / rb['tokens_per_s']:.2f}",
                "range": f"{low:.2f}-{high:.2f}",
                "verdict": WORD[said],
            }
        )
    return rows
