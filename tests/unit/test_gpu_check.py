"""The GPU check and `make test-gpu` on a machine without a GPU: the check's stages
run end to end on the CPU (a smoke run, the tiny preset), its profile window is one
step, a version skew is named, and `make test-gpu` installs nothing and skips cleanly.
What the check measures on a GPU is a recording (results/gpu_check/), not a test."""

import json
import os
import subprocess
import sys

import pytest

from distlab.bench import gpu_check
from distlab.infra.paths import REPO_ROOT

SMOKE = ["--device", "cpu", "--preset", "tiny", "--batch-size", "4", "--steps", "4"]
SMOKE += ["--repeats", "1", "--no-compile", "--skip-suite"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        [sys.executable, "-m", "distlab.bench.gpu_check", *SMOKE, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "gpu_check.json").read_text())


def test_the_smoke_run_records_lab_1_and_lab_4_with_provenance(smoke):
    _, result = smoke
    runs = {run["lab"]: run for run in result["throughput"]["runs"]}
    assert set(runs) == {"lab1_single", "lab4_fsdp2"}
    assert all(run["tokens_per_s"] > 0 and "error" not in run for run in runs.values())
    assert result["provenance"]["pinned"]["torch"] and result["provenance"]["finished"]
    assert result["provenance"]["command"].startswith(
        "python -m distlab.bench.gpu_check"
    )


def test_the_profile_window_is_one_step_of_lab_4(smoke):
    out, result = smoke
    profile = result["profile"]
    table = (out / "profile_lab4.txt").read_text()
    # the schedule's one active step: one ProfilerStep row, called once
    (row,) = [line for line in table.splitlines() if "ProfilerStep" in line]
    assert row.split()[-1] == "1"
    names = {op["name"] for op in profile["top_host_ops"]}
    assert names & {"aten::mm", "aten::addmm"}  # the step's matrix products
    # FSDP2's hooks ran inside the step, and took part of it
    hooks, step = profile["fsdp_hooks_host_ms"], profile["profiled_step_ms"]
    assert 0 < hooks < step  # timing-ok: spans inside the step's span, on one clock


def test_a_version_other_than_the_pin_is_named_and_a_build_tag_is_not(monkeypatch):
    versions = {"torch": "2.11.0+cu130", "accelerate": "1.15.0"}
    monkeypatch.setattr(gpu_check, "installed", versions.get)
    assert gpu_check.skew({"torch": "2.13.0", "accelerate": "1.15.0"}) == [
        "torch 2.11.0+cu130 here, 2.13.0 pinned"
    ]
    versions["torch"] = "2.13.0+cu130"
    assert gpu_check.skew({"torch": "2.13.0", "accelerate": "1.15.0"}) == []


def make(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, **env},
    )


def test_make_test_gpu_installs_nothing_and_takes_the_system_python_without_a_venv():
    for line in make("-n", "test-gpu").stdout.splitlines():
        assert "pip" not in line and "venv" not in line.replace(".venv/bin", "")
    # no .venv: the machine's python3 and its own torch
    dry = make("-n", "test-gpu", "BIN=/no/venv/bin", "PYTHON=python3").stdout
    assert "python3 -m pytest -m gpu" in dry


def test_make_test_gpu_skips_every_test_cleanly_without_cuda():
    proc = make("test-gpu", f"GPU_PY={sys.executable}", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "skipped" in last and "passed" not in last and "failed" not in last
    assert "pinned" in proc.stdout  # the versions against the pins, first


BOOK_BUILD = ("jupyter_book", "myst_nb", "nbclient", "matplotlib", "playwright")


def test_the_gpu_suite_imports_nothing_of_the_book_build():
    """`make test-gpu` runs where the machine's own Python may have torch and pytest
    but nothing of the book: collecting the GPU suite must not import it."""
    probe = (
        "import sys, pytest\n"
        "pytest.main(['-q', '--collect-only', '-m', 'gpu', '-p', 'no:cacheprovider',"
        " 'tests/gpu'])\n"
        f"print(sorted(m for m in {BOOK_BUILD!r} if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "collected" in proc.stdout or "tests collected" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"
