"""The README's book command, strict: `jupyter-book build book -W -n --keep-going`."""
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT
from test_notebooks import toc_pages


def test_strict_build_passes_and_writes_every_page(tmp_path):
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    proc = subprocess.run(
        [str(jupyter_book), "build", "book", "-W", "-n", "--keep-going", "--path-output", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    html = tmp_path / "_build" / "html"
    for page in toc_pages():
        rel = page.relative_to(REPO_ROOT / "book").with_suffix(".html")
        assert (html / rel).exists(), rel
    lab = (html / "labs" / "lab1_single.html").read_text()
    assert "<img" in lab and "Traceback" not in lab  # the loss plot, and no error output
