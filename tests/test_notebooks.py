"""Every notebook of the book executes, one test each, and every page is a real notebook.

The notebooks run once, in the strict book build (the ``built_book`` fixture); the tests
here read the notebooks that build executed, so ``make test`` does not run them twice."""
from pathlib import Path

import nbformat
import pytest
import yaml

from conftest import REPO_ROOT


def toc_pages() -> list[Path]:
    """The .md files the table of contents names (relative to book/)."""
    toc = yaml.safe_load((REPO_ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return [REPO_ROOT / "book" / f"{f}.md" for f in files]


NOTEBOOKS = sorted({p.resolve() for p in toc_pages()}
                   | set((REPO_ROOT / "book").glob("*.md")) | set((REPO_ROOT / "labs").glob("*.md")))


def test_every_notebook_in_the_tree_is_in_the_table_of_contents():
    in_toc = {p.resolve() for p in toc_pages()}
    assert set(NOTEBOOKS) == in_toc


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_page_is_a_myst_notebook(path):
    """Without the jupytext front matter a page's code cells are silently not executed."""
    text = path.read_text()
    assert text.startswith("---\njupytext:"), f"{path.name} lacks the jupytext front matter"
    assert "```{code-cell}" in text


@pytest.mark.xdist_group("book")  # on the worker that built the book (a session fixture per worker)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_notebook_executes(path, built_book):
    proc, build = built_book
    rel = path.relative_to(REPO_ROOT / "book") if (REPO_ROOT / "book") in path.parents \
        else Path("labs") / path.name
    executed = build / "jupyter_execute" / rel.with_suffix(".ipynb")
    assert executed.exists(), f"the book build did not execute {rel}:\n" + proc.stdout[-4000:]
    notebook = nbformat.read(executed, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.get("execution_count") for cell in code), f"{rel}: cells not executed"
    errors = [o for cell in code for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{rel}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
