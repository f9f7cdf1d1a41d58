"""In what dtype did a lab's matrix products run? The lab's script is run in this
process (one rank, ``distlab.bench.lab_scripts.run_here``) with a global forward hook
on every ``nn.Linear``, which notes the dtype of its output: bf16 exactly when the
product ran in bf16, whether autocast cast its inputs inside the op (labs 1-3, 6) or
FSDP2's policy cast the parameters (labs 4, 5, 6 with ``--fsdp``). A loss that merely
differs from fp32's cannot tell which tensors were rounded; this can.

    python tests/support/matmul_dtypes.py lab4_fsdp2 --dtype bf16 --steps 1 ...

prints one line of JSON: ``{"exit_status": 0, "dtypes": ["torch.bfloat16"]}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from distlab.bench.lab_scripts import run_here

ONE_STEP = ["--preset", "tiny", "--steps", "1", "--eval-batches", "1"]
ONE_STEP += ["--sample-chars", "0", "--no-progress"]


def matmul_dtypes(lab: str, out: Path, *args: str, device: str = "cpu") -> list[str]:
    """The dtypes of every ``nn.Linear`` output while ``lab`` trained one step of the
    tiny preset on ``device``, in a process of its own."""
    proc = subprocess.run(
        [sys.executable, __file__, lab, *ONE_STEP, "--device", device]
        + ["--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["exit_status"] == 0, proc.stderr[-3000:]
    return report["dtypes"]


def linear_output_dtypes(lab: str, args: list[str]) -> tuple[int, set[str]]:
    seen: set[str] = set()

    def note(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            seen.add(str(output.dtype))

    handle = torch.nn.modules.module.register_module_forward_hook(note)
    try:
        status = run_here(lab, args)
    finally:
        handle.remove()
    return status, seen


if __name__ == "__main__":
    status, seen = linear_output_dtypes(sys.argv[1], sys.argv[2:])
    print(json.dumps({"exit_status": status, "dtypes": sorted(seen)}))
