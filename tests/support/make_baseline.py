"""Regenerate tests/support/baselines/lab1_tiny_fp32.json: run only when the model, the
data pipeline or lab 1's loop change on purpose, and say why in the commit.

    python tests/support/make_baseline.py
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ARGS = [
    "--preset",
    "tiny",
    "--steps",
    "20",
    "--batch-size",
    "16",
    "--seed",
    "1337",
    "--eval-every",
    "20",
    "--eval-batches",
    "2",
    "--sample-chars",
    "40",
    "--no-progress",
]

if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "src"))
    from distlab.metrics import read_metrics

    out = tempfile.mkdtemp()
    subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "src/labs/lab1_single.py"),
            *ARGS,
            "--out",
            out,
        ],
        check=True,
        env=os.environ,
    )
    baseline = {
        "description": "lab 1, tiny preset, fp32 on CPU: the first 20 training losses",
        "args": ARGS,
        "abs_tolerance": 1e-4,
        "losses": [m["loss"] for m in read_metrics(out)],
    }
    (HERE / "baselines" / "lab1_tiny_fp32.json").write_text(
        json.dumps(baseline, indent=1) + "\n"
    )
    print(baseline["losses"])
