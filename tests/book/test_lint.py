"""The whole tree passes ruff's lint and format check (configuration:
pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

from distlab.infra.paths import REPO_ROOT

RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.parametrize(
    "check", [["check"], ["format", "--check"]], ids=["lint", "format"]
)
def test_ruff_passes_on_src_and_tests(check):
    proc = subprocess.run(
        [str(RUFF), *check, "src", "tests"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"ruff {' '.join(check)} src tests:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    )
