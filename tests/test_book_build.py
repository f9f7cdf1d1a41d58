"""The README's book command, strict: `jupyter-book build book -W -n --keep-going`."""
import pytest

from conftest import REPO_ROOT
from test_notebooks import toc_pages

pytestmark = pytest.mark.xdist_group("book")  # one xdist worker builds the book, once


def test_strict_build_passes_and_writes_every_page(built_book):
    proc, build = built_book
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for page in toc_pages():
        rel = page.relative_to(REPO_ROOT / "book").with_suffix(".html")
        assert (build / "html" / rel).exists(), rel
    lab = (build / "html" / "labs" / "lab1_single.html").read_text()
    assert "<img" in lab and "Traceback" not in lab  # the loss plot, and no error output
