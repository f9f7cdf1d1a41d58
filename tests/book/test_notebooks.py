"""The README's book command passes, strictly; every notebook of the book executes, one
test each; and every page is a real notebook.

The notebooks run once, in the strict book build (the ``built_book`` fixture); the tests
here read the notebooks that build executed, so ``make test`` does not run them twice.
The browser tests (test_book_in_browser.py) read the same build: the fixture shares it
between the xdist workers."""

import json

import pytest

from distlab.infra.book_build import executed_page, toc_pages
from distlab.infra.paths import REPO_ROOT

NOTEBOOKS = sorted(
    {p.resolve() for p in toc_pages()}
    | set((REPO_ROOT / "book").glob("*.md"))
    | set((REPO_ROOT / "labs").glob("*.md"))
)


def test_every_notebook_in_the_tree_is_in_the_table_of_contents():
    in_toc = {p.resolve() for p in toc_pages()}
    assert set(NOTEBOOKS) == in_toc


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_page_is_a_myst_notebook(path):
    """Without the jupytext front matter a page's code cells are silently
    not executed."""
    text = path.read_text()
    assert text.startswith("---\njupytext:"), (
        f"{path.name} lacks the jupytext front matter"
    )
    assert "```{code-cell}" in text


def build_failure(proc) -> str:
    """What names the cause in a failed build's output: the failing cell and its
    traceback (nbclient's report, which the build prints long before its own
    final traceback)."""
    text = proc.stdout + proc.stderr
    at = text.find("An error occurred while executing the following cell")
    return text[max(0, at - 300) : at + 8000] if at >= 0 else text[-8000:]


def test_strict_build_passes_and_writes_every_page(built_book):
    """`jupyter-book build book -W -n --keep-going`: warnings are errors, every page
    is written."""
    proc, build = built_book
    assert proc.args[0] != "reused", (
        f"DISTLAB_REUSE_BUILD is set: this run read {build}, it did not build"
    )
    assert proc.returncode == 0, build_failure(proc)
    for page in toc_pages():
        rel = page.relative_to(REPO_ROOT / "book").with_suffix(".html")
        assert (build / "html" / rel).exists(), rel
    # every page came from the pages executed two at a time (conftest.built_book): a
    # page the build executed itself, one after another, would mean the cache keys
    # disagree (a slower build)
    cached = proc.stdout.count("Using cached notebook")
    record = json.loads((build.parent.parent / "book.json").read_text())
    errors = "\n\n".join(
        f"{page} failed:\n{error}" for page, error in record["page_errors"].items()
    )
    assert cached == len(toc_pages()), (
        f"the build found {cached} of {len(toc_pages())} pages executed\n{errors}"
    )
    lab = (build / "html" / "labs" / "lab1_single.html").read_text()
    # the loss plot, and no error output
    assert "<img" in lab and "Traceback" not in lab


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_notebook_executes(path, built_book):
    """The page as the build rendered it, from the build's execution cache: every code
    cell ran, and none left an error."""
    proc, build = built_book
    try:
        notebook = executed_page(build / ".jupyter_cache", path)
    except KeyError:
        pytest.fail(
            f"the book build did not execute {path.name}:\n"
            + build_failure(proc)[:3000]
        )
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.get("execution_count") for cell in code), (
        f"{path.name}: cells not executed"
    )
    errors = [
        o
        for cell in code
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, (
        f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    )
