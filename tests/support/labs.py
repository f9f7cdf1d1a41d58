"""Running the lab scripts as a reader would, and the loss baseline they are held to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from distlab.infra.paths import LABS_DIR

BASELINES = Path(__file__).parent / "baselines"
# lab 1's losses on the tiny model (support/make_baseline.py); every distributed lab must match them
BASELINE = json.loads((BASELINES / "lab1_tiny_fp32.json").read_text())


def run_lab(script: str, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``src/labs/<script>`` as a user would, in a subprocess; never raises on failure."""
    return subprocess.run(
        [sys.executable, str(LABS_DIR / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def torchrun(script: str, nprocs: int, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone` as the README shows it (port 0: the OS picks a free one)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nprocs}",
            str(LABS_DIR / script),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
