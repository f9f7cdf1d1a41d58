"""The planner checked on this machine: its predictions for the recorded CPU runs of
labs 1-5.

    # python -m distlab.bench.planner_inputs
    inputs = json.loads(INPUTS.read_text())
    # python -m distlab.bench (labs 1-6, 1/2/4 ranks)
    recorded = json.loads(RECORDED.read_text())
    # predicted against measured, with the error
    rows = check_recorded(inputs, recorded)
    # the points of a predicted-vs-measured plot
    figure_data(rows)

The planner is fed only what ``distlab.bench.planner_inputs`` measured on this CPU with
as many ranks at once as the run had: the fp32 matmul peak per rank (the quantity each
recorded run timed at its end), a copy's bandwidth per rank with every rank copying, and
gloo's all-reduce alpha-beta fit (book/collectives.md). Nothing is fitted to the
recorded runs; the errors are what the planner's formulas make of these measurements.
Two of the bench's other measurements can stand in for the peak, to show which term a
miss comes from:

    check_recorded(inputs, recorded, rate="sustained", attention="measured")

computes at the rate a rank sustains while all ranks compute, and charges attention at
the rate SDPA's kernel was timed at, instead of the matmul peak.
"""

from __future__ import annotations

import dataclasses
import os

from distlab.costs.collectives import Link, collective_s
from distlab.infra.paths import RESULTS_DIR
from distlab.model import preset
from distlab.planner.predict import Cluster, Device, Plan, predict
from distlab.planner.shapes import SHAPES, ModelShape

INPUTS = RESULTS_DIR / "planner_cpu_inputs.json"
RECORDED = RESULTS_DIR / "bench" / "cpu_shakespeare_fp32.json"
CHECKED_LABS = (
    "lab1_single",
    "lab2_ddp",
    "lab3_grad_accum",
    "lab4_fsdp2",
    "lab5_activation_ckpt",
)
# the copy the planner's memory-bound ops stream at: the collectives chapter's 16 MB
# message, the size of the runs' own activation tensors (a micro-batch of 4 x 256
# tokens: 1.6 MB wide C, 6.3 MB wide 4C; lab 2's 16 sequences: 6.3 and 25 MB), all of
# them inside the 32 MB L3 cache or close to it
COPY_KEY = "copy_16mb_bytes_per_s"
# the compute rate a rank gets
RATES = {"peak": "peak_flops_per_s", "sustained": "sustained_flops_per_s"}


def machine_memory_bytes() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measured_at(inputs: dict, ranks: int) -> dict:
    """The measurements made with ``ranks`` ranks at once, or a clear error."""
    by_ranks = inputs["by_ranks"]
    if str(ranks) not in by_ranks:
        raise ValueError(
            f"no planner inputs measured at {ranks} ranks; measured at: "
            f"{', '.join(by_ranks)}"
        )
    return by_ranks[str(ranks)]


def cpu_cluster(
    inputs: dict, ranks: int, rate: str = "peak", attention: str = "matmul"
) -> Cluster:
    """This machine as the planner sees it when ``ranks`` ranks share it: each rank a
    device. ``rate``: "peak" computes at the matmul peak the recorded runs timed
    (``distlab.flops``, the mean of the ranks' best calls); "sustained" at the median of
    back-to-back calls, what a rank keeps up while every other rank computes too (they
    differ when 4 ranks share 2 cores). ``attention``: "matmul" charges attention at
    that rate too; "measured" at the rate the bench timed SDPA's causal forward and
    backward at (about a third of the matmul's on this CPU)."""
    if rate not in RATES:
        raise ValueError(
            f"unknown compute rate {rate!r}; choose one of {', '.join(RATES)}"
        )
    if attention not in ("matmul", "measured"):
        raise ValueError(
            f"unknown attention rate {attention!r}; choose matmul or measured"
        )
    m = measured_at(inputs, ranks)
    compute = m[RATES[rate]]
    device = Device(
        name=f"CPU rank ({m['threads_per_rank']} thread(s), {ranks} rank(s) at once)",
        peak_flops=compute,
        # the ranks share the machine's memory: a rank can hold its share of it
        memory_bytes=machine_memory_bytes() / ranks,
        # copy_bandwidth counts the bytes copied; each is read once and written once,
        # and the planner's traffic (elementwise_values_per_token, loss_bytes_per_token,
        # the optimizer's 84 B/param) counts reads and writes: the copy moved twice the
        # bytes it counts
        mem_bandwidth=2 * m[COPY_KEY],
        # the peak IS a measured matmul (2048^3, fp32) at this rank count: the fraction
        # it reaches is 1 by definition (the model's own matmuls reach it:
        # torch.profiler put lab 1's step's matmuls at 1.44 s, 182 GFLOP/s, against the
        # 183 peak its run timed)
        matmul_efficiency=1.0,
        attention_efficiency=1.0
        if attention == "matmul"
        else m["attention_flops_per_s"] / compute,
        source="python -m distlab.bench.planner_inputs "
        "(results/planner_cpu_inputs.json)",
    )
    if ranks > 1:
        link = Link(
            "gloo loopback",
            m["all_reduce_alpha_s"],
            m["all_reduce_bandwidth"],
            "collectives chapter's fit",
        )
    # one rank sends nothing: collective_s is 0 for a group of 1, whatever the link
    else:
        link = Link("none (one rank)", 0.0, float("inf"), "no communication")
    # overlap=False: gloo's transfers run on the same CPU cores as the compute, nothing
    # hides (the step model of book/ddp_scaling.md is checked on this machine without
    # overlap, as here)
    return Cluster(
        device, gpus=ranks, gpus_per_node=ranks, intra=link, inter=None, overlap=False
    )


def shape_of(run: dict) -> ModelShape:
    """The run's model: its preset's shape, with the vocabulary the run's data had. The
    vocabulary is solved from the run's own parameter count (GPT-2 family: V*C of the
    tied embedding)."""
    name = run["config"]["preset"]
    if name not in SHAPES:
        raise ValueError(
            f"no planner shape for preset {name!r}; shapes: {', '.join(SHAPES)}"
        )
    base = SHAPES[name]
    without_vocab = dataclasses.replace(base, vocab_size=0).n_params()
    vocab, rest = divmod(run["parameters"] - without_vocab, base.d_model)
    if rest or vocab < 1:
        raise ValueError(
            f"{run['parameters']:,} parameters is no vocabulary of the {name!r} shape"
        )
    return dataclasses.replace(base, vocab_size=vocab)


def plan_of(run: dict) -> Plan:
    """The planner's Plan of a recorded lab run (what its script and options did)."""
    lab, n, cfg = run.get("lab"), run["world_size"], run["config"]
    if lab not in CHECKED_LABS:
        raise ValueError(
            f"no plan for lab {lab!r}; the planner is checked on "
            f"{', '.join(CHECKED_LABS)}"
        )
    seq_len, batch = preset(cfg["preset"]).block_size, cfg["batch_size"]
    if run["tokens_per_step"] != batch * seq_len:
        raise ValueError(
            f"{lab}: {run['tokens_per_step']} tokens per step is not {batch} x "
            f"{seq_len}"
        )
    # gradients reduced in fp32
    common = {"seq_len": seq_len, "precision": cfg["dtype"], "reduce_bytes": 4}
    if lab in ("lab1_single", "lab2_ddp"):
        if lab == "lab1_single" and n != 1:
            raise ValueError(f"lab1_single runs on one process, not {n}")
        # one rank: DDP's collectives cost 0
        return Plan("ddp", micro_batch=batch // n, accum=1, **common)
    micro = cfg["micro_batch_size"]
    accum = batch // (n * micro)
    if accum != (run.get("accum_steps") or accum):
        raise ValueError(
            f"{lab}: {batch} / ({n} x {micro}) is not the run's "
            f"{run['accum_steps']} micro-batches"
        )
    sync = cfg.get("sync_every_micro_batch", False)
    if lab == "lab3_grad_accum":
        return Plan(
            "ddp", micro_batch=micro, accum=accum, sync_every_micro_batch=sync, **common
        )
    ac, every = "none", 2
    if lab == "lab5_activation_ckpt":
        every = cfg["ac_every"]
        # the lab's "full" checkpoints every k-th block; its "selective" keeps the
        # matmuls' outputs (op level)
        modes = {
            "none": "none",
            "full": "full" if every == 1 else "selective-layer",
            "selective": "selective-op",
        }
        if cfg["ac"] not in modes:
            raise ValueError(
                f"{lab}: unknown --ac {cfg['ac']!r}; the lab has {', '.join(modes)}"
            )
        ac = modes[cfg["ac"]]
    return Plan(
        "fsdp2",
        micro_batch=micro,
        accum=accum,
        ac=ac,
        ac_every=max(every, 1),
        sync_every_micro_batch=sync,
        **common,
    )


def error_pct(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured


def check_run(
    inputs: dict, run: dict, rate: str = "peak", attention: str = "matmul"
) -> dict:
    """One recorded run: what the planner predicts for it against what was measured."""
    n = run["world_size"]
    p = predict(shape_of(run), cpu_cluster(inputs, n, rate, attention), plan_of(run))
    mem, t = p["memory"], p["time"]
    # the model state held over the step (the peak's parts are what exists at the peak)
    state = mem["state"]
    return {
        "lab": run["lab"],
        "ranks": n,
        "tokens_per_s": {
            "predicted": p["tokens_per_s_per_gpu"] * n,
            "measured": run["tokens_per_s"],
        },
        "step_s": {"predicted": t["step"], "measured": run["step_s"]},
        "state_bytes": {
            "predicted": state,
            "measured": run["state_bytes_per_rank"]["total"],
        },
        "peak_bytes": {
            "predicted": mem["total"],
            "measured": run["peak_bytes_by_kind"]["total"],
        },
        # where the predicted step goes, to find which term a miss comes from
        "predicted_seconds": {
            k: t[k]
            for k in ("matmul", "attention", "memory-bound", "exposed", "optimizer")
        },
        "predicted_memory": {
            k: v
            for k, v in mem.items()
            if k not in ("total", "state", "capacity", "fits")
        },
        "measured_memory": dict(run["peak_bytes_by_kind"]),
    }


def check_recorded(
    inputs: dict, recorded: dict, rate: str = "peak", attention: str = "matmul"
) -> list[dict]:
    """Labs 1-5 at every rank count recorded (lab 6, Accelerate, is not planned): one
    row each, with the error of each prediction in percent of the measurement (``rate``,
    ``attention``: see ``cpu_cluster``)."""
    rows = []
    for run in recorded["runs"]:
        if run.get("lab") not in CHECKED_LABS or "error" in run:
            continue
        row = check_run(inputs, run, rate, attention)
        for what in ("tokens_per_s", "step_s", "state_bytes", "peak_bytes"):
            row[what]["error_pct"] = error_pct(
                row[what]["predicted"], row[what]["measured"]
            )
        rows.append(row)
    return sorted(rows, key=lambda r: (CHECKED_LABS.index(r["lab"]), r["ranks"]))


def collectives_check(inputs: dict) -> list[dict]:
    """FSDP2's two collectives as the planner costs them (the ring, fed the all-reduce's
    fit) against their measured time, 16 MB on 2 and 4 ranks: gloo's are slower than
    half an all-reduce."""
    rows = []
    for n in sorted(int(k) for k in inputs["by_ranks"] if int(k) > 1):
        m, link = measured_at(inputs, n), cpu_cluster(inputs, n).intra
        for kind in ("all_gather", "reduce_scatter"):
            predicted, measured = (
                collective_s(kind.replace("_", "-"), 2**24, n, link),
                m[f"{kind}_16mb_s"],
            )
            rows.append(
                {
                    "collective": kind,
                    "ranks": n,
                    "predicted_s": predicted,
                    "measured_s": measured,
                }
            )
            rows[-1]["error_pct"] = error_pct(predicted, measured)
    return rows


def figure_data(rows: list[dict]) -> dict[str, list[tuple[str, float, float]]]:
    """For a predicted-vs-measured plot: (label, predicted, measured) per run, tokens/s
    and peak MB."""
    label = lambda r: f"{r['lab'].split('_')[0]} x{r['ranks']}"  # noqa: E731
    return {
        "tokens_per_s": [
            (label(r), r["tokens_per_s"]["predicted"], r["tokens_per_s"]["measured"])
            for r in rows
        ],
        "peak_mb": [
            (
                label(r),
                r["peak_bytes"]["predicted"] / 1e6,
                r["peak_bytes"]["measured"] / 1e6,
            )
            for r in rows
        ],
    }


def table(rows: list[dict]) -> str:
    """The rows as text: tokens/s, model state and peak bytes, predicted / measured
    / error."""
    lines = [
        f"{'lab':22} {'N':>2} {'tok/s pred':>10} {'meas':>6} {'err%':>6}  "
        f"{'state MB':>8} {'meas':>6} {'err%':>6}"
        f"  {'peak MB':>7} {'meas':>6} {'err%':>6}"
    ]
    for r in rows:
        t, s, p = r["tokens_per_s"], r["state_bytes"], r["peak_bytes"]
        lines.append(
            f"{r['lab']:22} {r['ranks']:2} {t['predicted']:10.0f} "
            f"{t['measured']:6.0f} {t['error_pct']:+6.1f}  "
            f"{s['predicted'] / 1e6:8.1f} {s['measured'] / 1e6:6.1f} "
            f"{s['error_pct']:+6.2f}  "
            f"{p['predicted'] / 1e6:7.1f} {p['measured'] / 1e6:6.1f} "
            f"{p['error_pct']:+6.1f}"
        )
    return "\n".join(lines)


# python -m distlab.planner.cpu_check: both tables, from the recorded files
if __name__ == "__main__":
    import json

    inputs, recorded = (json.loads(path.read_text()) for path in (INPUTS, RECORDED))
    print("at the matmul peak:\n" + table(check_recorded(inputs, recorded)))
    print("\nat the sustained matmul rate, attention at its own:")
    print(
        table(check_recorded(inputs, recorded, rate="sustained", attention="measured"))
    )
    for c in collectives_check(inputs):
        print(
            f"{c['collective']:15} 16 MB on {c['ranks']}: ring "
            f"{c['predicted_s'] * 1e3:5.1f} ms, measured "
            f"{c['measured_s'] * 1e3:5.1f} ms ({c['error_pct']:+.0f}%)"
        )
