"""Shared test set-up: the data file, an isolated cache, and how to run a lab."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session", autouse=True)
def _environment(tmp_path_factory):
    """Tests read Tiny Shakespeare from the workspace copy when it exists (no network),
    and keep their cache (peak FLOP/s, downloads) out of the user's home."""
    if SHARED_DATA.exists() and "DISTLAB_DATA" not in os.environ:
        os.environ["DISTLAB_DATA"] = str(SHARED_DATA)
    os.environ["DISTLAB_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    os.environ.setdefault("TQDM_DISABLE", "1")
    yield


def pytest_collection_modifyitems(items):
    """The book's tests first: the strict build they share is the longest task of the suite,
    so under xdist the worker that takes this file must start it before anything else."""
    items.sort(key=lambda item: item.path.name != "test_notebooks.py")  # stable: keeps the rest in order


def run_lab(script: str, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``src/labs/<script>`` as a user would, in a subprocess; never raises on failure."""
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "src" / "labs" / script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def built_book(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The README's book command, strict (`jupyter-book build book -W -n --keep-going`), run
    once per session: it executes every notebook, and the notebook tests read what it ran.
    Returns the finished process and the build folder (holding html/ and jupyter_execute/)."""
    out = tmp_path_factory.mktemp("book")
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    proc = subprocess.run(
        [str(jupyter_book), "build", "book", "-W", "-n", "--keep-going", "--path-output", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800,
    )
    return proc, out / "_build"
