"""Where things are in the repository: one definition, for everything that runs
from it."""

from pathlib import Path

# src/distlab/infra/paths.py -> the repository
REPO_ROOT = Path(__file__).resolve().parents[3]
LABS_DIR = REPO_ROOT / "src" / "labs"  # the six lab scripts
EXAMPLES_DIR = REPO_ROOT / "src" / "examples"  # scripts the pages run by path
RESULTS_DIR = REPO_ROOT / "results"  # recorded benchmarks the pages read
