"""Every notebook of the book executes, one test each, and every page is a real notebook."""
from pathlib import Path

import jupytext
import pytest
import yaml
from nbclient import NotebookClient

from conftest import REPO_ROOT

CELL_TIMEOUT_S = 600


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_notebook_executes(path):
    notebook = jupytext.read(path)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the failing cell, on any error
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
