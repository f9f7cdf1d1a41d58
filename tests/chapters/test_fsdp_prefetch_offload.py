"""FSDP2 prefetching and CPU offload: the offload benchmark's CPU smoke run. The page
(book/fsdp_prefetch_offload.md) runs every prefetch setting and the offload tour on 2
gloo ranks in one launch and asserts on every build what they hold and issue, that
CPUOffloadPolicy on CPU ranks changes only its flag, that the recorded GPU benchmark's
memory fell by the 12 bytes a parameter that offloading moves, and that the exercise's
verdict rejects wrong timelines."""

import json
import os
import subprocess
import sys

from distlab.infra.paths import REPO_ROOT


def test_offload_benchmark_smoke_run_on_the_cpu(tmp_path):
    out = tmp_path / "offload.json"
    env = dict(os.environ, DISTLAB_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "distlab.bench.fsdp_offload",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        timeout=120,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["dtype"], r["offload"]) for r in runs] == [
        ("fp32", False),
        ("fp32", True),
    ]
    # the same steps with the shards offloaded
    assert runs[0]["losses"] == runs[1]["losses"]
    assert all(
        r["peak_gpu_bytes"] is None and len(r["step_s"]) == result["settings"]["steps"]
        for r in runs
    )
    assert result["provenance"]["command"].startswith(
        "python -m distlab.bench.fsdp_offload --device cpu"
    )


def test_gather_labels_are_spread_apart_in_bounds_and_in_order():
    # the stepper's label row: all-gathers a few operators apart must not collide
    from distlab.figures.label_row import spread

    xs = [6, 25, 49, 56, 118, 180, 242]
    at = spread(xs, 50, 0, 400)
    assert all(b - a >= 50 - 1e-9 for a, b in zip(at, at[1:]))
    assert 0 <= at[0] and at[-1] <= 400
    assert spread([10, 200, 390], 50, 0, 400) == [10, 200, 390]  # nothing to move
