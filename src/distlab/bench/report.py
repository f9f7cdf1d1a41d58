"""What the recorded benchmarks (``python -m distlab.bench``) say: the project's goals,
and the GPU recordings beside the CPU one.

The harness's last lines and the Benchmarks chapter both read the goals through
``targets``, so a verdict in the book is computed one way only. ``gpu_section`` is what
the chapter shows of the GPU recordings or, while there is none, says so and gives the
command that makes one. The chapter's own tables and figures (scaling, loss agreement,
memory) are in ``distlab.chapters.benchmarks``, as are ``run`` and ``activations``,
which read one run of a result for both.

    result = load_result("results/bench/cpu_shakespeare_fp32.json")
    targets(result)       # each goal: measured value, its range, met/missed/noise
    gpu_section(recorded_results())  # what the chapter shows of the GPU recordings
"""

from __future__ import annotations

import json
from pathlib import Path

from distlab.chapters.benchmarks import LAB_NAMES, MB, activations, loss_agreement, run
from distlab.infra.paths import REPO_ROOT

RESULTS = REPO_ROOT / "results" / "bench"


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def recorded_results(folder: str | Path = RESULTS) -> dict[str, dict]:
    """Every result file in ``folder``, by file name (without .json)."""
    return {p.stem: load_result(p) for p in sorted(Path(folder).glob("*.json"))}


def _tps(r: dict) -> list[float]:
    """A run's tokens/s, one per recorded repeat (the median alone for old files)."""
    return list(r.get("tokens_per_s_repeats") or [r["tokens_per_s"]])


def ratio_range(a: list[float], b: list[float]) -> tuple[float, float]:
    """The smallest and largest a/b that the repeats allow: min(a)/max(b) to
    max(a)/min(b). One number each gives one point, which no verdict rests on."""
    return min(a) / max(b), max(a) / min(b)


def verdict(low: float, high: float, goal: float, direction: str, exact: bool) -> str:
    """ "met" or "missed" only when the whole range from ``low`` to ``high`` sits on one
    side of ``goal``; a range that straddles it is "within noise". A timing with no
    repeats (``low == high`` and not ``exact``) is "within noise" too: one sample never
    carries a verdict. Counted bytes are ``exact``: their range is a point."""
    if low == high and not exact:
        return "within noise"
    ok_low = low >= goal if direction == ">=" else low <= goal
    ok_high = high >= goal if direction == ">=" else high <= goal
    if ok_low and ok_high:
        return "met"
    if not ok_low and not ok_high:
        return "missed"
    return "within noise"


def _mfu(R) -> tuple[float, float, float] | None:
    r = R("lab1_single", 1)
    if r["mfu"] is None:
        return None
    # one peak was measured per run: MFU moves with the repeats' tokens/s
    per = [r["mfu"] * t / r["tokens_per_s"] for t in _tps(r)]
    return r["mfu"], min(per), max(per)


def _speed(R, a: tuple, b: tuple, inverse: bool = False):
    ra, rb = R(*a), R(*b)
    lo, hi = ratio_range(_tps(ra), _tps(rb))
    value = ra["tokens_per_s"] / rb["tokens_per_s"]
    if inverse:  # a step-time ratio is the inverse tokens/s ratio
        return 1 / value, 1 / hi, 1 / lo
    return value, lo, hi


def _point(value: float) -> tuple[float, float, float]:
    return value, value, value


# (name, what is compared, goal, direction, exact (counted, not timed), how it is
# computed from the runs: (value, low, high))
_GOALS = [
    (
        "lab 1 MFU",
        "lab 1, fp32, 1 process: MFU of the measured matmul peak",
        0.80,
        ">=",
        False,
        _mfu,
    ),
    (
        "DDP vs lab 1",
        "tokens/s: lab 2 on 2 ranks / lab 1 on 1",
        0.90,
        ">=",
        False,
        lambda R: _speed(R, ("lab2_ddp", 2), ("lab1_single", 1)),
    ),
    (
        "FSDP2 vs DDP",
        "tokens/s: lab 4 / lab 3 (same micro-batches), 2 ranks",
        0.90,
        ">=",
        False,
        lambda R: _speed(R, ("lab4_fsdp2", 2), ("lab3_grad_accum", 2)),
    ),
    (
        "FSDP2 state",
        "model state bytes per rank: lab 4 / lab 3, 2 ranks",
        0.52,
        "<=",
        True,
        lambda R: _point(
            R("lab4_fsdp2", 2)["state_bytes_per_rank"]["total"]
            / R("lab3_grad_accum", 2)["state_bytes_per_rank"]["total"]
        ),
    ),
    (
        "full AC time",
        "step time: lab 5 (full AC) / lab 4, 2 ranks",
        1.35,
        "<=",
        False,
        lambda R: _speed(
            R, ("lab5_activation_ckpt", 2), ("lab4_fsdp2", 2), inverse=True
        ),
    ),
    (
        "full AC activations",
        "activation bytes at the peak: lab 5 / lab 4, 2 ranks",
        0.20,
        "<=",
        True,
        lambda R: _point(
            activations(R("lab5_activation_ckpt", 2)) / activations(R("lab4_fsdp2", 2))
        ),
    ),
]


def targets(result: dict) -> list[dict]:
    """Each goal with its measured value and the range its repeats allow (``low``,
    ``high``). ``verdict`` is "met" or "missed" only where that range lies wholly on
    one side of the goal, else "within noise" (see ``verdict``); ``met`` is True or
    False with it, None when within noise or when the runs it needs are missing
    ("not measured", with ``missing``)."""

    def R(lab: str, n: int) -> dict:  # noqa: N802 - reads like the table
        found = run(result, lab, n)
        if found is None:
            raise LookupError(f"{lab} at {n} rank(s)")
        return found

    rows = []
    for name, compared, goal, direction, exact, compute in _GOALS:
        row = {"goal": name, "compared": compared, "target": f"{direction} {goal}"}
        # the one figure a run may leave None
        missing = "an MFU: it came out above 1 and was not recorded"
        try:
            got = compute(R)
        except LookupError as err:
            got, missing = None, str(err)
        if got is None:
            row.update(measured=None, low=None, high=None, met=None)
            row.update(verdict="not measured", missing=missing)
        else:
            value, low, high = got
            said = verdict(low, high, goal, direction, exact)
            met = {"met": True, "missed": False}.get(said)
            row.update(measured=value, low=low, high=high, met=met, verdict=said)
        rows.append(row)
    return rows


def print_targets(result: dict) -> None:
    print("\ngoal                  target   measured (range of the repeats)")
    for row in targets(result):
        if row["measured"] is None:
            print(
                f"{row['goal']:21} {row['target']:>8}   not measured (no "
                f"{row['missing']})"
            )
        else:
            print(
                f"{row['goal']:21} {row['target']:>8}   {row['measured']:.3f} "
                f"({row['low']:.2f}-{row['high']:.2f})  {row['verdict'].upper()}"
            )


# What makes a GPU recording: GPT-2 small's shape in bf16, 16 sequences of 1,024 tokens
# per GPU and step (the labs' suggestion for GPUs; unmeasured here), the host synced
# every 10 steps. On more GPUs: their count in --ranks, a --batch-size that grows with
# it; and once more with --compile (its own file).
GPU_COMMAND = (
    "python -m distlab.bench --device cuda --preset gpt2 --dtype bf16 --batch-size 64 "
    "--micro-batch-size 64 --log-every 10 --steps 30 --repeats 3 --ranks 1"
)


def as_shell(command: str, width: int = 78) -> str:
    """``command`` as shell lines of at most ``width`` characters, broken between
    options (an option keeps its value), continued with backslashes."""
    program, *options = command.split(" --")
    lines = [program]
    for option in ("--" + o for o in options):
        if len(lines[-1]) + 1 + len(option) > width:
            lines.append(option)
        else:
            lines[-1] += " " + option
    return " \\\n    ".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def recordings_table(results: dict[str, dict]) -> list[dict]:
    """Every recorded result side by side, CPU and GPU: where, which workload, and lab
    1's figures."""
    rows = []
    for name, r in results.items():
        p, w, lab1 = r["provenance"], r["workload"], run(r, "lab1_single", 1) or {}
        on_gpus = f"{p.get('gpu_count')} x {p['machine']}"
        rows.append(
            {
                "recording": name,
                "measured on": on_gpus
                if w["device"] == "cuda"
                else f"{p['machine']}, {p['cpu_count']} cores",
                "workload": f"{w['preset']}, {w['dtype']}, batch {w['global_batch']}"
                + (", compiled" if w.get("compile") else ""),
                "ranks": ", ".join(
                    map(str, sorted({x["world_size"] for x in r["runs"]}))
                ),
                "lab 1 tokens/s": f"{lab1['tokens_per_s']:,.0f}" if lab1 else "-",
                "lab 1 MFU, measured peak": _fmt(lab1.get("mfu")),
                # GPUs in DATASHEET_PEAKS only
                "lab 1 MFU, datasheet peak": _fmt(lab1.get("mfu_of_datasheet_peak")),
                "date": p["date"][:10],
            }
        )
    return rows


def gpu_runs_table(result: dict) -> list[dict]:
    """One row per run of a GPU recording: speed, MFU of both peaks, rank 0's peak CUDA
    memory, and how far its losses were from lab 1's."""
    agreement, rows = loss_agreement(result), []
    for r in result["runs"]:
        ok = "error" not in r
        cuda = "cuda_max_memory_allocated" in r
        rows.append(
            {
                "lab": LAB_NAMES[r["lab"]],
                "ranks": str(r["world_size"]),
                "tokens/s": f"{r['tokens_per_s']:,.0f}"
                if ok
                else "failed: " + r["error"],
                "MFU, measured peak": _fmt(r["mfu"]) if ok else "-",
                "MFU, datasheet peak": _fmt(r.get("mfu_of_datasheet_peak"))
                if ok
                else "-",
                "CUDA peak MB, allocated / reserved": (
                    f"{r['cuda_max_memory_allocated'] / MB:,.0f} / "
                    f"{r['cuda_max_memory_reserved'] / MB:,.0f}"
                    if cuda
                    else "-"
                ),
                "loss, largest rel. difference from lab 1": (
                    f"{agreement[r['lab'], r['world_size']]:.1e}"
                    if (r["lab"], r["world_size"]) in agreement
                    else "-"
                ),
            }
        )
    return rows


def gpu_section(results: dict[str, dict]) -> list:
    """What the page's GPU section shows, in order (a str is printed, a list of rows is
    a table): the recordings side by side and each GPU recording's runs; with none, that
    plainly (the page prints GPU_COMMAND once, after this)."""
    gpu = {name: r for name, r in results.items() if r["workload"]["device"] == "cuda"}
    if not gpu:
        return [
            "No GPU recording has been made yet: every figure on this page was "
            "measured on the CPU machine above. On a machine with CUDA GPUs, "
            "the command printed at the end of this section makes one, "
            "results/bench/cuda_gpt2_bf16.json."
        ]
    shown: list = [recordings_table(results)]
    for name, r in gpu.items():
        p = r["provenance"]
        shown.append(
            f"{name}: {p.get('gpu_count')} x {p['machine']}, NVIDIA driver "
            f"{p.get('nvidia_driver')}, "
            f"CUDA {p.get('cuda')}, NCCL {p.get('nccl')}, torch {p['torch']}, "
            f"commit {p['commit']}, {p['date']}\n"
            f"  {p['command']}"
        )
        shown.append(gpu_runs_table(r))
    return shown
