"""Regenerate tests/support/baselines/lab1_tiny_fp32.json: run only when the model, the
data pipeline or lab 1's loop change on purpose, and say why in the commit.

    python tests/support/make_baseline.py

The run warms up over 6 steps, then holds the learning rate at its peak (``--min-lr``
is the default ``--lr``, 1e-3): past step 5 the schedule no longer depends on
``--steps``, so the first N steps of any run with these options are the baseline's, and
a run of 8 steps already has 2 past the warm-up to compare (``support.compare``: a
gradient N times too large shows only in the gradient norm, and only once the warm-up
stops scaling the updates).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[1]  # the repository
WARMUP = 6
ARGS = [
    "--preset",
    "tiny",
    "--steps",
    "20",
    "--batch-size",
    "16",
    "--seed",
    "1337",
    "--warmup-steps",
    str(WARMUP),
    "--min-lr",
    "1e-3",  # the default --lr: constant after the warm-up
    "--eval-every",
    "20",
    "--eval-batches",
    "2",
    "--sample-chars",
    "40",
    "--no-progress",
]

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    from distlab.metrics import read_metrics

    out = tempfile.mkdtemp()
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "src" / "labs" / "lab1_single.py"),
            *ARGS,
            "--out",
            out,
        ],
        check=True,
        env=os.environ,
    )
    metrics = read_metrics(out)
    baseline = {
        "description": (
            "lab 1, tiny preset, fp32 on CPU, 20 steps: a 6-step warm-up, then the "
            "learning rate constant at its peak (so any prefix of a run with these "
            "args is this run); each step's training loss and gradient norm"
        ),
        "args": ARGS,
        "abs_tolerance": 1e-4,
        "warmup_steps": WARMUP,
        "records": [
            {"step": m["step"], "loss": m["loss"], "grad_norm": m["grad_norm"]}
            for m in metrics
        ],
    }
    (HERE / "baselines" / "lab1_tiny_fp32.json").write_text(
        json.dumps(baseline, indent=1) + "\n"
    )
    print([r["loss"] for r in baseline["records"]])
