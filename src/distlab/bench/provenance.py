"""Where, when and how a measurement was made, written next to the measurement.

Every benchmark in this repository writes its result through ``write_result``, with
``provenance``: the machine and its CPU or GPU, the core count, the CPU's instruction
sets that decide matmul speed (a CPU with ``avx512_bf16`` or ``amx_bf16`` multiplies
bf16 natively; one without converts it and is far slower in bf16 than in fp32), torch,
the commit (marked ``+dirty`` when tracked files had changes), the date, the command
that made it, and how busy the machine was (the load average: on a shared machine, other
people's work slows a benchmark down). On CUDA it adds the GPUs (``gpu_provenance``):
their names and count, the NVIDIA driver, and the CUDA and NCCL versions torch was built
with. ``finished`` adds the end time and the load then.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
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
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(module: str, argv: list[str] | None, device: str = "auto") -> dict:
    """Where and when a measurement was made, and the command that made it."""
    command = " ".join(sys.argv[1:] if argv is None else map(str, argv))
    measured_on = pick_device(device)
    return {
        "machine": device_name(measured_on),
        "cpu_count": os.cpu_count(),
        # from /proc/cpuinfo: which of distlab.flops.ISA_FLAGS it has
        "cpu_flags": cpu_isa_flags(),
        # the vector ISA torch's CPU kernels use
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": load_average(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m {module} {command}".strip(),
        **(gpu_provenance() if measured_on.type == "cuda" else {}),
    }


def gpu_provenance() -> dict:
    """The GPUs a CUDA measurement could use: what each is, the driver, CUDA
    and NCCL."""
    import torch.cuda.nccl  # not imported by ``import torch``

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        # as this process sees them (CUDA_VISIBLE_DEVICES applies)
        "gpu_count": len(names),
        "gpu_names": names,
        "nvidia_driver": nvidia_driver(),
        "cuda": torch.version.cuda,  # the CUDA runtime torch was built with
        # the NCCL torch carries (a CUDA build without it, Windows', has none)
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))
        if torch.distributed.is_nccl_available()
        else None,
    }


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version (550.54.15, say), from nvidia-smi; None where it
    cannot tell."""
    # torch has no call that returns the driver's version
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next(iter(out.split()), None)  # one line per GPU, all the same driver


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (runnable processes), where the OS
    has them."""
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
    """Write a benchmark's result (with its provenance) as indented JSON, and
    say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {path}")
    return path
