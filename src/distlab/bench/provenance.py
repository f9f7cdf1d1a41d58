"""Where, when and how a measurement was made, written next to the measurement.

Every benchmark in this repository writes its result through ``write_result``, with
``provenance``: the machine and its CPU or GPU, the core count, the CPU's instruction sets that
decide matmul speed (a CPU with ``avx512_bf16`` or ``amx_bf16`` multiplies bf16 natively; one
without converts it and is far slower in bf16 than in fp32), torch, the commit (marked
``+dirty`` when tracked files had changes), the date, the command that made it, and how busy
the machine was (the load average: on a shared machine, other people's work slows a benchmark
down). ``finished`` adds the end time and the load then.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from distlab.flops import cpu_isa_flags, device_name
from distlab.infra.paths import REPO_ROOT
from distlab.runtime import pick_device


def commit() -> str:
    """The commit measured; "+dirty" when tracked files had uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(module: str, argv: list[str] | None, device: str = "auto") -> dict:
    """Where and when a measurement was made, and the command that made it."""
    command = " ".join(sys.argv[1:] if argv is None else map(str, argv))
    return {
        "machine": device_name(pick_device(device)),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_isa_flags(),  # from /proc/cpuinfo: which of distlab.flops.ISA_FLAGS it has
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the vector ISA torch's CPU kernels use
        "load_average": load_average(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m {module} {command}".strip(),
    }


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (runnable processes), where the OS has them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def finished(prov: dict) -> dict:
    """``prov`` with the time the measurement ended and the load average then."""
    prov["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    prov["load_average_at_end"] = load_average()
    return prov


def write_result(result: dict, path: str | Path) -> Path:
    """Write a benchmark's result (with its provenance) as indented JSON, and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {path}")
    return path
