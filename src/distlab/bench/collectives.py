"""Record what all-reduces cost on gloo ranks, for book/collectives.md.

    python -m distlab.bench.collectives                 # about 2 minutes on 2 cores
    python -m distlab.bench.collectives --rounds 3 --out /tmp/collectives.json

Each round is one launch of ``--nprocs`` gloo ranks running
``distlab.chapters.collectives.time_collectives`` at the chapter's sizes, 1 KB to
16 MB: ``dist.all_reduce`` and the chapter's ``ring_all_reduce`` at every size (21
repeats below 4 MB, 7 from 4 MB on, each starting at a barrier), then gloo's
reduce-scatter and all-gather at 16 MB. After each round one process copies 16 MB in
memory (``copy_bandwidth``): the rate that a transfer through the loopback device,
which copies the bytes with the CPU, cannot beat. Every repeat of every rank is kept,
with the load average at the start of each round, and the result goes to ``--out``
(default ``results/collectives_bench.json``) with its provenance.

The page reads it with ``load``: the rounds are pooled (a repeat lasts as long as its
slower rank), the median and quartiles of the pool are drawn (``timing_figure``), and
each round's own median shows how far the rounds differ. ``findings`` words the page's
sentences from the recording, each with a guard: a sentence whose shape the recording
does not show is replaced by one that says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from distlab.bench.provenance import finished, load_average, provenance, write_result
from distlab.chapters.collectives import (
    ALL_REDUCES,
    SIZES,
    copy_bandwidth,
    summarise_timings,
    time_collectives,
)
from distlab.cli import run
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT
from distlab.scratch.collectives import model_time

SCHEMA = 1
DEFAULT_OUT = REPO_ROOT / "results" / "collectives_bench.json"
HALVES = ("dist.reduce_scatter_single", "dist.all_gather_single")


def _records(times: dict) -> list[dict]:
    """``time_collectives``'s {(name, bytes): seconds} as JSON records."""
    return [{"name": n, "bytes": b, "seconds": s} for (n, b), s in times.items()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="launches (default 5)")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.nprocs < 2:
        parser.error("--rounds must be positive and --nprocs at least 2")
    result = {
        "schema": SCHEMA,
        "provenance": provenance("distlab.bench.collectives", argv, "cpu"),
        "workload": {"sizes": SIZES, "nprocs": args.nprocs, "rounds": args.rounds},
        "rounds": [],
    }
    for _ in range(args.rounds):
        load = load_average()
        per_rank = run_ranks(time_collectives, args.nprocs, (SIZES,), timeout=600)
        result["rounds"].append(
            {
                "load_average": load,
                "by_rank": [_records(t) for t in per_rank],
                "copy_bytes_per_s": copy_bandwidth(SIZES[-1]),
            }
        )
    finished(result["provenance"])
    write_result(result, args.out)
    return result


def load(path: str | Path = DEFAULT_OUT) -> dict:
    """The recording, its rounds pooled: ``summarise_timings`` of every repeat of every
    round, each round's own medians, and the copy rate (median of the rounds)."""
    recorded = json.loads(Path(path).read_text())
    rounds = [
        [
            {(r["name"], r["bytes"]): r["seconds"] for r in rank}
            for rank in rd["by_rank"]
        ]
        for rd in recorded["rounds"]
    ]
    pooled = [
        {key: [t for rd in rounds for t in rd[rank][key]] for key in rounds[0][rank]}
        for rank in range(len(rounds[0]))
    ]
    summary = summarise_timings(pooled)
    # each round's median, a repeat as long as its slower rank
    summary["round_medians"] = {
        key: [summarise_timings(rd)["median"][key] for rd in rounds]
        for key in summary["median"]
    }
    summary["copy_bw"] = statistics.median(
        rd["copy_bytes_per_s"] for rd in recorded["rounds"]
    )
    summary["loads"] = [rd["load_average"][0] for rd in recorded["rounds"]]
    summary["cores"] = recorded["provenance"]["cpu_count"]
    return {"provenance": recorded["provenance"], "summary": summary}


def _worded(holds: bool, sentence: str, showing: str, summary: dict) -> str:
    """``sentence`` when the recording shows its shape; else a sentence saying so."""
    if holds:
        return sentence
    loads = summary["loads"]
    return (
        f"This recording does not show {showing} (load average {min(loads):.1f} to "
        f"{max(loads):.1f} on {summary['cores']} cores while it ran); rerun "
        "`python -m distlab.bench.collectives` on a quieter machine."
    )


def findings(
    summary: dict, small_bytes: int = 16 * 1024, large_bytes: int = 2**20
) -> dict[str, str]:
    """The page's sentences about the recording, each worded from it with a guard:
    messages up to ``small_bytes`` should cost one flat latency, and from
    ``large_bytes`` on the bus bandwidth should level off."""
    med, bw, rounds = summary["median"], summary["busbw"], summary["round_medians"]
    sizes, big = summary["sizes"], summary["sizes"][-1]
    lib = {s: med["dist.all_reduce", s] for s in sizes}
    small = [lib[s] for s in sizes if s <= small_bytes]
    floor = statistics.median(small)
    fit = summary["fit"]["dist.all_reduce"]
    # the size at which the model's two terms are equal: N alpha B
    crossover = summary["ranks"] * fit["alpha"] * fit["bandwidth"]
    knee = next((s for s in sizes if lib[s] > 2 * floor), 0)
    flat = max(small) < 1.5 * min(small) and small_bytes < crossover <= knee
    rate = {s: bw["dist.all_reduce", s] for s in sizes}
    large = [rate[s] for s in sizes if s >= large_bytes]
    level = max(large) < 1.5 * min(large) and min(large) > 20 * rate[sizes[0]]
    ring = med["ring_all_reduce", big] / lib[big]
    # slower in every round: the ring's fastest round behind gloo's slowest
    ring_slower = min(rounds["ring_all_reduce", big]) > max(
        rounds["dist.all_reduce", big]
    )
    rs, ag = (med[h, big] / lib[big] for h in HALVES)
    ms = lambda t: f"{t * 1e3:.2f} ms"  # noqa: E731 - a format, named once
    gb = lambda b: f"{b / 1e9:.2f} GB/s"  # noqa: E731
    return {
        "floor": _worded(
            flat,
            f"Up to {small_bytes // 1024} KB an all-reduce took about {ms(floor)}, "
            "whatever its size: a fixed cost per message. It first took twice that at "
            f"{knee // 1024:,} KB; the fitted model puts the point where its two "
            f"terms are equal at about {crossover / 1024:,.0f} KB.",
            "a flat latency floor for small messages",
            summary,
        ),
        "slope": _worded(
            level,
            f"From {large_bytes >> 20} MB on, time grows with the bytes: the bus "
            f"bandwidth stays between {gb(min(large))} and {gb(max(large))}, against "
            f"{rate[sizes[0]] / 1e9:.3f} GB/s at {sizes[0] // 1024} KB. One 16 MB copy "
            f"inside one process ran at {gb(summary['copy_bw'])}.",
            "the bus bandwidth levelling off for large messages",
            summary,
        ),
        "ring": _worded(
            ring_slower,
            f"At {big >> 20} MB our ring took {ring:.1f} times as long as "
            "`dist.all_reduce`, and it was slower in every round.",
            "our ring slower than gloo's all-reduce in every round",
            summary,
        ),
        "halves": _worded(
            rs > 0.75,
            f"At {big >> 20} MB gloo's reduce-scatter took {rs:.2f} times an "
            f"all-reduce's time, and its all-gather {ag:.2f} times. A 16 MB copy in "
            f"memory took {ms(big / summary['copy_bw'])}, the all-reduce "
            f"{ms(lib[big])}.",
            "a reduce-scatter costing at least an all-reduce",
            summary,
        ),
    }


def timing_figure(summary: dict):
    """Time and bus bandwidth against message size: medians of the pooled repeats,
    their middle half as a band, and the model fitted to ``dist.all_reduce``."""
    import matplotlib.pyplot as plt

    n, sizes, per_repeat, median, busbw = (
        summary[k] for k in ("ranks", "sizes", "per_repeat", "median", "busbw")
    )
    fig, (ax_t, ax_bw) = plt.subplots(2, 1, figsize=(7, 8), sharex=True)
    kb = [s / 1024 for s in sizes]
    for name, color in zip(ALL_REDUCES, ("#3b6ea5", "#e39b4c")):
        q1, _, q3 = zip(
            *(statistics.quantiles(per_repeat[name, s], n=4) for s in sizes)
        )
        ax_t.fill_between(
            kb, [q * 1e3 for q in q1], [q * 1e3 for q in q3], color=color, alpha=0.25
        )
        ax_t.plot(
            kb, [median[name, s] * 1e3 for s in sizes], "o-", color=color, label=name
        )
        ax_bw.plot(
            kb, [busbw[name, s] / 1e9 for s in sizes], "o-", color=color, label=name
        )
    fit = summary["fit"]["dist.all_reduce"]
    model = [model_time(fit["alpha"], fit["bandwidth"], n, s) * 1e3 for s in sizes]
    ax_t.plot(kb, model, "--", color="#555", label="model fitted to dist.all_reduce")
    ax_t.set_ylabel("time (ms)", fontsize=13)
    ax_t.set_title(f"all-reduce on {n} gloo ranks (recorded)", fontsize=14)
    ax_bw.axhline(
        summary["copy_bw"] / 1e9,
        color="#999",
        ls=":",
        label=f"one {sizes[-1] >> 20} MB copy in memory",
    )
    ax_bw.set_ylabel("bus bandwidth (GB/s)", fontsize=13)
    ax_bw.set_xlabel("message size (KB)", fontsize=13)
    for ax in (ax_t, ax_bw):
        ax.set(xscale="log", yscale="log")
        ax.set_xticks(kb, [f"{k:,.0f}" for k in kb], fontsize=11)
        ax.tick_params(axis="y", labelsize=11)
        ax.minorticks_off()
        ax.legend(fontsize=11)
        ax.grid(alpha=0.3)
        # plain numbers, not powers of ten
        ax.yaxis.set_major_formatter(lambda y, _: f"{y:g}")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    run(main, "python -m distlab.bench.collectives")
