"""The lab scripts as the labs benchmark sees them: each one's file, the script loaded
as a module (its ``TrainConfig``; ``main()`` does not run), the options it takes, and
the command line of one benchmark run.

    load_lab("lab3_grad_accum").TrainConfig
    lab_options("lab1_single")              # {"preset", "steps", ...}
    lab_args("lab4_fsdp2", workload, out)   # ["--preset", "tiny", ...]
    check_options_exist(workload, {"lab2_ddp"})  # before anything runs
    run_here("lab4_fsdp2", ["--preset", "tiny"])  # as __main__, in this process

``distlab.bench.labs`` plans, runs and records the runs; tests that read a lab's
``TrainConfig`` load the script here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import runpy
import sys
import types
from pathlib import Path

from distlab.errors import UserError
from distlab.infra.paths import LABS_DIR

LABS = {
    1: "lab1_single",
    2: "lab2_ddp",
    3: "lab3_grad_accum",
    4: "lab4_fsdp2",
    5: "lab5_activation_ckpt",
    6: "lab6_accelerate",
}
# options passed on to every lab only when asked for, so a plain run's command line
# is unchanged
PASSED_ON = {"compile": "--compile", "log_every": "--log-every", "tf32": "--tf32"}


def lab_path(lab: str) -> Path:
    return LABS_DIR / f"{lab}.py"


@functools.cache
def load_lab(lab: str) -> types.ModuleType:
    """A lab script as a module (its TrainConfig, its functions); its main() does
    not run."""
    name = f"distlab_lab_{lab}"
    spec = importlib.util.spec_from_file_location(name, lab_path(lab))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_here(lab: str, args: list[str]) -> int:
    """Run a lab script as ``python src/labs/<lab>.py ARGS`` would, but in this process
    (one rank, no torchrun), so that the caller can watch it: a profiler, a global
    module hook. Returns its exit status."""
    argv = sys.argv
    sys.argv = [str(lab_path(lab)), *map(str, args)]
    try:
        runpy.run_path(str(lab_path(lab)), run_name="__main__")
    except SystemExit as stop:  # a UserError ends a lab with sys.exit("...")
        if stop.code not in (None, 0):
            print(stop.code, file=sys.stderr)
            return stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = argv
    return 0


def lab_options(lab: str) -> set[str]:
    """The option names (``micro_batch_size``...) of a lab script, read from its
    TrainConfig."""
    return {field.name for field in dataclasses.fields(load_lab(lab).TrainConfig)}


def lab_args(lab: str, workload: dict, out: Path) -> list[str]:
    """The command line of one run: the workload's options, plus what every benchmark
    run needs."""
    args = [
        "--preset",
        workload["preset"],
        "--batch-size",
        workload["global_batch"],
        "--steps",
        workload["steps"],
    ]
    args += [
        "--dtype",
        workload["dtype"],
        "--device",
        workload["device"],
        "--eval-batches",
        workload["eval_batches"],
    ]
    args += ["--sample-chars", 0, "--no-progress", "--out", out]
    if "micro_batch_size" in lab_options(lab):
        args += ["--micro-batch-size", workload["micro_batch_size"]]
    if workload.get("compile"):
        # no --track-memory: MemTracker is a dispatch mode round a step that compiled
        # blocks run in, an interaction not tried here; on CUDA the allocator's peaks
        # are recorded anyway
        args.append("--compile")
    else:
        args.append("--track-memory")
    if workload.get("log_every", 1) != 1:
        args += ["--log-every", workload["log_every"]]
    if workload.get("tf32"):
        args.append("--tf32")
    return [str(a) for a in args]


def check_options_exist(workload: dict, labs: set[str]) -> None:
    """A flag passed on to the labs must be one each of them has (an older lab script
    may not)."""
    asked = [name for name in ("compile", "tf32") if workload[name]] + ["log_every"] * (
        workload["log_every"] != 1
    )
    for lab in sorted(labs):
        missing = [PASSED_ON[name] for name in asked if name not in lab_options(lab)]
        if missing:
            raise UserError(
                f"{lab} has no {', '.join(missing)} option: drop it from the "
                "benchmark's command line"
            )
