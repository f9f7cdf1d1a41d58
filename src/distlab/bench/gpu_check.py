"""The GPU check: what a GPU owner runs once, about 10 minutes on one H100, to record
what this project's GPU paths do there.

    make gpu-check                         # the same as the next line
    python -m distlab.bench.gpu_check      # into results/gpu_check/<gpu>_<date>/
    python -m distlab.bench.gpu_check --environment  # the versions (make test-gpu)
    # a smoke run on the CPU, about a minute (tests/unit/test_gpu_check.py runs it)
    python -m distlab.bench.gpu_check --device cpu --preset tiny --batch-size 4 \\
        --steps 6 --repeats 1 --no-compile --skip-suite --out /tmp/check

Its stages, each written to ``OUT/gpu_check.json`` as soon as it ends (a check cut off
keeps the stages before):

1. **environment**: torch, CUDA, NCCL, the GPUs and the driver (``bench.provenance``),
   and the versions of torch and accelerate against the pins in requirements.txt. A GPU
   machine often has its own torch and no package registry: a skew is printed and
   recorded, and the check runs on.
2. **suite**: ``pytest -m gpu tests/gpu``, its counts and log (``suite.log``).
3. **throughput**: lab 1 on the ``gpt2`` preset in bf16, eager and compiled, and lab 4
   on one GPU (eager), through ``distlab.bench`` (each run ``--repeats`` times, the
   median kept, every repeat's tokens/s recorded): tokens/s, MFU of the measured matmul
   peak and of the datasheet's, rank 0's peak CUDA memory. ``--log-every 10``: the host
   syncs once per 10 steps.
4. **profile**: one step of lab 4 itself (the script, run in this process) under
   ``torch.profiler``: the operators by host time and by GPU time
   (``profile_lab4.txt``), and the share of the step during which the GPU ran a kernel.
   A step whose GPU idles most of the time is bound by the host (Python, FSDP2's hooks,
   kernel launches), not by its matrix products.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

from distlab.bench import labs as bench_labs
from distlab.bench.gpu_busy import busy_us, union_us
from distlab.bench.lab_scripts import run_here
from distlab.bench.provenance import finished, provenance, write_result
from distlab.infra.paths import REPO_ROOT, RESULTS_DIR
from distlab.runtime import pick_device

PINNED = ("torch", "accelerate")  # the packages whose version changes what runs
PROFILED_STEP = 5  # lab 4's step under the profiler: after the allocator has settled
TABLE_ROWS = 15


def pins(requirements: Path = REPO_ROOT / "requirements.txt") -> dict[str, str]:
    """The pinned version of each of ``PINNED``, from requirements.txt."""
    found = {}
    for line in requirements.read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip() in PINNED and version:
            found[name.strip()] = version.split()[0]
    return found


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def skew(pinned: dict[str, str]) -> list[str]:
    """One line per package whose installed version is not the pinned one (a local
    build tag such as +cu130 is not a skew)."""
    lines = []
    for name, want in pinned.items():
        have = installed(name)
        if have is None:
            lines.append(f"{name} is not installed ({want} pinned)")
        elif have.split("+")[0] != want:
            lines.append(f"{name} {have} here, {want} pinned")
    return lines


def environment(device: torch.device, argv: list[str] | None) -> dict:
    """Stage 1: where the check runs, and how far its versions are from the pins."""
    env = provenance("distlab.bench.gpu_check", argv, device.type)
    env["python"] = sys.version.split()[0]
    env["pinned"] = pins()
    env["installed"] = {name: installed(name) for name in (*PINNED, "torchao")}
    env["version_skew"] = skew(env["pinned"])
    env["cuda_available"] = torch.cuda.is_available()
    print(
        f"torch {torch.__version__} (pinned {env['pinned'].get('torch')}), "
        f"CUDA {torch.version.cuda}, GPUs: {env.get('gpu_names') or 'none'}"
    )
    for line in env["version_skew"]:
        print(f"version skew: {line}; the check runs with what is installed")
    return env


def suite(out: Path, timeout: float) -> dict:
    """Stage 2: the GPU tests, their counts from pytest's JUnit report."""
    report, log = out / "suite.xml", out / "suite.log"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests/gpu",
        "-rs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log.write_text(proc.stdout + proc.stderr)
        status = proc.returncode
    except subprocess.TimeoutExpired as err:
        log.write_text(f"{err.stdout or ''}{err.stderr or ''}\ncut off at {timeout} s")
        status = None
    result = {"command": " ".join(command[2:]), "exit_status": status}
    result["seconds"] = round(time.perf_counter() - start, 1)
    if report.exists():
        suites = ET.parse(report).getroot()
        suites = [suites] if suites.tag == "testsuite" else list(suites)
        for key in ("tests", "failures", "errors", "skipped"):
            result[key] = sum(int(s.get(key, 0)) for s in suites)
        result["passed"] = result["tests"] - sum(
            result[k] for k in ("failures", "errors", "skipped")
        )
    print(
        "suite: "
        + ", ".join(f"{result.get(k, '?')} {k}" for k in ("passed", "failures"))
        + f", {result.get('skipped', '?')} skipped in {result['seconds']} s"
        + ("" if status is not None else " (cut off)")
    )
    return result


def workload(args, device: torch.device) -> list:
    """The options every run of the check shares: one GPU's whole batch in one
    forward (``--micro-batch-size`` the batch: lab 4 does lab 1's work)."""
    batch = ["--batch-size", args.batch_size, "--micro-batch-size", args.batch_size]
    return [
        "--device",
        device.type,
        "--preset",
        args.preset,
        "--dtype",
        args.dtype,
        *batch,
    ]


def throughput(args, device: torch.device, out: Path) -> dict:
    """Stage 3: lab 1 eager and compiled, lab 4 eager, through ``distlab.bench``."""
    common = [
        *workload(args, device),
        "--steps",
        args.steps,
        "--log-every",
        min(10, args.steps),
        "--repeats",
        args.repeats,
        "--ranks",
        "1",
        "--eval-batches",
        "1",
        "--runs-dir",
        out / "runs",
    ]
    plans = {"eager": ["--labs", "1", "4"]}
    if args.compile:
        plans["compiled"] = ["--labs", "1", "--compile"]
    runs = []
    for variant, labs in plans.items():
        result = bench_labs.main(
            [*map(str, common), *labs, "--out", str(out / f"bench_{variant}.json")]
        )
        for run in result["runs"]:
            runs.append({"variant": variant, **keep(run)})
    return {"runs": runs}


def keep(run: dict) -> dict:
    """What the check records of one benchmark run."""
    names = (
        "lab",
        "world_size",
        "dtype",
        "tokens_per_step",
        "tokens_per_s",
        "tokens_per_s_repeats",
        "step_s",
        "mfu",
        "mfu_of_datasheet_peak",
        "datasheet_peak",
        "cuda_max_memory_allocated",
        "command",
        "error",
    )
    return {name: run[name] for name in names if name in run}


def profile_lab4(args, device: torch.device, out: Path) -> dict:
    """Stage 4: lab 4's step ``PROFILED_STEP``, the script itself run in this process,
    under ``torch.profiler``. A global optimizer hook moves the profiler on at the end
    of every optimizer step, so its one active window is exactly one step, from the
    end of the step before to the end of this one's optimizer step."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=schedule(wait=PROFILED_STEP - 1, warmup=1, active=1, repeat=1),
    )
    handle = register_optimizer_step_post_hook(lambda *_: prof.step())
    lab_args = [
        *workload(args, device),
        # the profiled step is no log point: no host sync in it
        "--steps",
        PROFILED_STEP + 3,
        "--log-every",
        100,
        "--eval-batches",
        1,
        "--sample-chars",
        0,
        "--no-progress",
        "--out",
        out / "runs" / "lab4_profiled",
    ]
    try:
        with prof:
            status = run_here("lab4_fsdp2", lab_args)
    finally:
        handle.remove()
    if status:
        return {"error": f"lab 4 stopped with exit status {status}"}
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    step_us = max(end for _, end in spans) - min(start for start, _ in spans)
    averages = prof.key_averages()
    by_host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)
    tables = [
        "host (self CPU time), one step of lab 4 under the profiler:\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)
    ]
    result = {
        "step": PROFILED_STEP,
        "command": "python src/labs/lab4_fsdp2.py " + " ".join(map(str, lab_args)),
        "profiled_step_ms": step_us / 1e3,
        # the host's time inside FSDP2's hooks: its own record_function ranges
        # (FSDP::pre_forward, FSDP::post_backward_reduce...), nested ones counted once
        "fsdp_hooks_host_ms": union_us(
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == DeviceType.CPU and e.name.startswith("FSDP::")
        )
        / 1e3,
        "top_host_ops": [
            {
                "name": a.key,
                "calls": a.count,
                "self_cpu_ms": a.self_cpu_time_total / 1e3,
            }
            for a in by_host[:TABLE_ROWS]
        ],
    }
    if device.type == "cuda":
        busy = busy_us(events)
        result["gpu_busy_ms"] = busy / 1e3
        result["gpu_busy_share"] = busy / step_us
        tables.append(
            "GPU (self device time):\n"
            + averages.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS)
        )
    (out / "profile_lab4.txt").write_text("\n\n".join(tables) + "\n")
    share = result.get("gpu_busy_share")
    print(
        f"profile: lab 4 step {PROFILED_STEP} took {result['profiled_step_ms']:.1f} ms "
        f"under the profiler, {result['fsdp_hooks_host_ms']:.1f} ms of it in FSDP2's "
        "hooks"
        + (f", the GPU ran kernels {share:.0%} of it" if share is not None else "")
    )
    return result


def default_out(device: torch.device) -> Path:
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return RESULTS_DIR / "gpu_check" / f"{slug}_{datetime.date.today():%Y-%m-%d}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="sequences per step, on the one GPU (default: 32)",
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per lab run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per lab")
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="no compiled run"
    )
    parser.add_argument("--skip-suite", action="store_true", help="no pytest -m gpu")
    parser.add_argument(
        "--suite-timeout", type=float, default=300, help="seconds for the GPU suite"
    )
    parser.add_argument(
        "--environment",
        action="store_true",
        help="print the versions against the pins, and stop",
    )
    parser.add_argument("--out", default="", help="a folder (default: results/...)")
    args = parser.parse_args(argv)
    if args.environment:
        # where CUDA is, its device; the versions are what counts here
        device = pick_device("cuda" if torch.cuda.is_available() else "cpu")
        return environment(device, argv)
    if args.steps < 3 or args.repeats < 1 or args.batch_size < 1:
        parser.error("--steps must be at least 3, --repeats and --batch-size 1 or more")
    device = pick_device(args.device)  # cuda without a GPU: an error that says why
    out = Path(args.out) if args.out else default_out(device)
    out.mkdir(parents=True, exist_ok=True)
    result = {"provenance": environment(device, argv)}
    result["settings"] = {**vars(args), "out": str(out)}
    path = out / "gpu_check.json"
    stages = [("throughput", throughput), ("profile", profile_lab4)]
    if not args.skip_suite:
        stages.insert(0, ("suite", lambda a, d, o: suite(o, a.suite_timeout)))
    for name, stage in stages:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        result[name] = stage(args, device, out)
        result[name]["stage_s"] = round(time.perf_counter() - start, 1)
        write_result(result, path)  # after each stage: a cut-off check keeps these
    result["provenance"] = finished(result["provenance"])
    write_result(result, path)
    for run in result["throughput"]["runs"]:
        print(f"{run['variant']:9s} {run['lab']:12s} {figures(run)}")
    return result


def figures(run: dict) -> str:
    """One benchmark run in a line: tokens/s and their spread, MFU, peak memory."""
    if "error" in run:
        return f"failed: {run['error']}"
    repeats = run.get("tokens_per_s_repeats") or [run["tokens_per_s"]]
    line = (
        f"{run['tokens_per_s']:10,.0f} tokens/s (repeats {min(repeats):,.0f} to "
        f"{max(repeats):,.0f})"
    )
    if run.get("mfu_of_datasheet_peak") is not None:
        line += f"  MFU {run['mfu_of_datasheet_peak']:.3f} of the datasheet peak"
    if run.get("cuda_max_memory_allocated"):
        line += f"  CUDA peak {run['cuda_max_memory_allocated'] / 2**30:.1f} GiB"
    return line


if __name__ == "__main__":
    main()
