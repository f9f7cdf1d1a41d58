"""Benchmark the labs: every strategy on the same workload, at 1, 2, 4... ranks.

    python -m distlab.bench --preset shakespeare --batch-size 16 --steps 12 \\
        --ranks 1 2 4
    python -m distlab.bench --labs 1 2 --ranks 1 2 --preset tiny --steps 5 \\
        --out /tmp/b.json
    # 2 GPUs, 64 sequences each; again with --compile
    python -m distlab.bench --device cuda --preset gpt2 --dtype bf16 --batch-size 128 \\
        --micro-batch-size 64 --log-every 10 --steps 30 --ranks 1 2

Each run is a real run of a lab script, ``src/labs/labN_*.py``, launched as torchrun
would launch it, with the same options for every lab: model preset, global batch, steps,
dtype and, for labs 3 to 6, micro-batch size (so each lab differs from the one before by
its one feature). From each run's ``summary.json`` and ``metrics.jsonl`` the result
keeps tokens/s (the first two steps left out), MFU of the measured matmul peak (timed at
the end of each run by all its ranks at once; on a GPU also MFU of the datasheet peak),
bytes of model state per rank, the peak bytes by kind of rank 0's second step (PyTorch's
MemTracker, the labs' ``--track-memory``), the losses, and the exact command line. Lab 1
runs on one process only. On a shared machine one run's speed can be far off the next's
(the recorded repeats say how far): ``--repeats K`` runs the whole plan K times over and
keeps, for each lab and rank count, the run with the median tokens/s. On CUDA each rank
is a GPU (``--ranks`` above the GPU count is refused before anything starts), and each
run also keeps rank 0's peak CUDA memory (``torch.cuda.max_memory_allocated``,
``max_memory_reserved``). ``--compile``, ``--log-every`` and ``--tf32`` are passed on to
every lab. The scripts, their options and a run's command line are
``distlab.bench.lab_scripts``; this module plans the runs, launches them and keeps the
result.

The result goes to ``--out`` (default ``results/bench/<device>_<preset>_<dtype>.json``,
with ``_tf32`` and ``_compile`` added when those were asked for) with its provenance (on
CUDA: the GPUs, their driver, CUDA and NCCL versions); the Benchmarks chapter reads
these files and never reruns them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from distlab.bench.lab_scripts import LABS, check_options_exist, lab_args, lab_path
from distlab.bench.provenance import finished, provenance, write_result
from distlab.bench.report import print_targets
from distlab.errors import UserError
from distlab.infra.launch import LaunchTimeout, RankFailed, run_script
from distlab.infra.paths import REPO_ROOT
from distlab.metrics import read_metrics, read_summary
from distlab.runtime import pick_device

SCHEMA = 2  # bump when the layout of a result file changes; the tests read this layout
# 2: MFU of a peak timed by every run itself (peak_measured_with), the datasheet MFU;
# load and CPU flags (added since, so read with .get: the workload's
# compile/log_every/tf32, CUDA peaks, the GPU provenance)

# what the result keeps of each lab's summary.json
KEPT = (
    "lab",
    "strategy",
    "world_size",
    "accum_steps",
    "dtype",
    "device",
    "device_name",
    "tokens_per_step",
    "tokens_per_s",
    "achieved_flops_per_s",
    "peak_flops_per_s",
    "peak_measured_with",
    "mfu",
    "datasheet_peak",
    "mfu_of_datasheet_peak",
    "state_bytes_per_rank",
    "peak_bytes_by_kind",
    "final_train_loss",
    "final_val_loss",
    "parameters",
    "config",
)
# kept too where a lab's summary has them: rank 0's peak bytes on a CUDA device (none on
# a CPU)
CUDA_PEAKS = ("cuda_max_memory_allocated", "cuda_max_memory_reserved")


def run_one(
    lab: str, nprocs: int, workload: dict, runs_dir: Path, timeout: float
) -> dict:
    """One lab at ``nprocs`` ranks: its figures, or the error that stopped it."""
    out = runs_dir / f"{lab}_{nprocs}ranks"
    args = lab_args(lab, workload, out)
    record = {
        "lab": lab,
        "world_size": nprocs,
        "command": f"torchrun --nproc-per-node={nprocs} src/labs/{lab}.py "
        + " ".join(args),
    }
    try:
        run_script(
            lab_path(lab),
            args,
            nprocs=nprocs,
            timeout=timeout,
            device=workload["device"],
            quiet=True,
        )
    except (RankFailed, LaunchTimeout) as err:
        return {**record, "error": str(err).splitlines()[0]}
    summary = read_summary(out)
    record.update({key: summary.get(key) for key in KEPT})
    record.update({key: summary[key] for key in CUDA_PEAKS if key in summary})
    record["step_s"] = summary["tokens_per_step"] / summary["tokens_per_s"]
    record["losses"] = [m["loss"] for m in read_metrics(out)]
    return record


def median_run(repeats: list[dict]) -> dict:
    """The repeat with the median tokens/s (the lower of the two middle ones), with
    every repeat's tokens/s; a failed repeat makes the whole entry a failure."""
    failed = [r for r in repeats if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(repeats, key=lambda r: r["tokens_per_s"])
    return {
        **ordered[(len(ordered) - 1) // 2],
        "tokens_per_s_repeats": [r["tokens_per_s"] for r in repeats],
    }


def describe(run: dict) -> str:
    if "error" in run:
        return f"failed: {run['error']}"
    memory = run["peak_bytes_by_kind"].get("total", 0) / 1e6
    # None: above 1, the peak was no peak
    mfu = "-" if run["mfu"] is None else f"{run['mfu']:.2f}"
    if run.get("mfu_of_datasheet_peak") is not None:
        mfu += f" ({run['mfu_of_datasheet_peak']:.2f} of the datasheet's)"
    cuda = (
        f"  CUDA peak {run['cuda_max_memory_allocated'] / 1e6:,.0f} MB"
        if "cuda_max_memory_allocated" in run
        else ""
    )
    return (
        f"{run['tokens_per_s']:9,.0f} tokens/s  MFU {mfu}  state "
        f"{run['state_bytes_per_rank']['total'] / 1e6:6.1f} MB/rank  peak "
        f"{memory:6.1f} MB{cuda}  "
        f"loss {run['final_train_loss']:.4f}"
    )


def check_gpus_for(ranks: list[int], device: torch.device) -> None:
    """On CUDA every rank needs a GPU of its own: refuse a rank count above the GPUs
    there are."""
    if device.type == "cuda" and max(ranks) > torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UserError(
            f"--ranks {max(ranks)} needs {max(ranks)} GPUs (one per rank) and "
            f"this machine shows {count}: "
            f"ask for at most {count} ranks, or run on --device cpu"
        )


def result_name(workload: dict) -> str:
    """cpu_shakespeare_fp32, cuda_gpt2_bf16, cuda_gpt2_bf16_compile...: a variant gets a
    file of its own."""
    name = f"{workload['device']}_{workload['preset']}_{workload['dtype']}"
    return name + "_tf32" * workload["tf32"] + "_compile" * workload["compile"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--labs",
        type=int,
        nargs="+",
        default=list(LABS),
        choices=list(LABS),
        help="which labs (default: 1 2 3 4 5 6)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="rank counts to run labs 2-6 at; lab 1 always runs on 1 (default: 1 2 4)",
    )
    parser.add_argument(
        "--preset", default="shakespeare", help="model preset (default: shakespeare)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="global batch, sequences per step (default: 16)",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=4,
        help="labs 3-6: a rank's sequences per forward (default: 4)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=12,
        help="steps per run; the first 2 are not timed (default: 12)",
    )
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="(default: fp32)"
    )
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        help="batches in the final validation loss (default: 4)",
    )
    parser.add_argument(
        "--device", default="auto", help="auto, cpu or cuda (default: auto)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="every lab with --compile (torch.compile)",
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=1,
        help="every lab logs (and syncs with the host) every K steps (default: 1)",
    )
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="every lab with --tf32: fp32 matmuls may use TF32 on GPUs",
    )
    parser.add_argument(
        "--out",
        default="",
        help="result file (default: results/bench/<device>_<preset>_<dtype>.json)",
    )
    parser.add_argument(
        "--runs-dir",
        default="runs/bench",
        help="where the runs write their logs (default: runs/bench)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each lab and rank count, interleaved; the median by tokens/s "
        "is kept (default: 1)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds per run before it is killed",
    )
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first two steps are not timed)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.log_every < 1:
        parser.error("--log-every must be at least 1")
    for n in args.ranks:
        if n < 1 or args.batch_size % (n * args.micro_batch_size):
            parser.error(
                f"--batch-size {args.batch_size} does not split into micro-batches of "
                f"{args.micro_batch_size} over {n} ranks"
            )

    # "auto" resolved once: every lab runs on the same kind of device
    device = pick_device(args.device)
    check_gpus_for(args.ranks, device)  # before anything starts
    workload = {
        "preset": args.preset,
        "global_batch": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "steps": args.steps,
        "dtype": args.dtype,
        "device": device.type,
        "eval_batches": args.eval_batches,
        "repeats": args.repeats,
        "compile": args.compile,
        "log_every": args.log_every,
        "tf32": args.tf32,
    }
    plan = [
        (LABS[lab], n)
        for n in sorted(set(args.ranks))
        for lab in args.labs
        if lab != 1 or n == 1
    ]
    if 1 in args.labs and 1 not in args.ranks:
        plan.insert(0, (LABS[1], 1))
    check_options_exist(workload, {lab for lab, _ in plan})
    # taken before the first run: the commit (and whether it was dirty) of the code that
    # runs, even if files are edited while a long benchmark goes on
    measured = provenance("distlab.bench", argv, device.type)
    runs_dir = Path(args.runs_dir)
    # round after round over the plan, not each run k times in a row: a slow spell of a
    # shared machine then spreads over every lab instead of falling on one
    made: dict[tuple[str, int], list[dict]] = {}
    total = len(plan) * args.repeats
    for _ in range(args.repeats):
        for lab, n in plan:
            start = time.perf_counter()
            print(
                f"[{len(sum(made.values(), [])) + 1}/{total}] {lab} on {n} rank(s) ...",
                end="",
                flush=True,
            )
            made.setdefault((lab, n), []).append(
                run_one(lab, n, workload, runs_dir, args.timeout)
            )
            print(
                f" {time.perf_counter() - start:4.0f} s  {describe(made[lab, n][-1])}",
                flush=True,
            )
    runs = [median_run(made[key]) for key in plan]

    result = {
        "schema": SCHEMA,
        "provenance": finished(measured),
        "workload": workload,
        "runs": runs,
    }
    write_result(
        result,
        args.out or REPO_ROOT / "results" / "bench" / f"{result_name(workload)}.json",
    )
    print_targets(result)  # the project's goals, met or not
    return result


if __name__ == "__main__":
    main()
