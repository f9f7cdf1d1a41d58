"""The diff between two lab scripts, generated from the files, for the book to show.

A hand-copied diff drifts from the code (Accelerate's by_feature examples and several
PyTorch tutorials did); this one is computed from ``src/labs`` every time a page builds.
"""

from __future__ import annotations

import difflib

from distlab.infra.paths import LABS_DIR


def lab_diff(old: str, new: str, context: int = 2) -> str:
    """Unified diff of ``src/labs/<old>`` -> ``src/labs/<new>``, with
    repository-relative names."""
    a = (LABS_DIR / old).read_text().splitlines()
    b = (LABS_DIR / new).read_text().splitlines()
    return "\n".join(
        difflib.unified_diff(
            a, b, f"src/labs/{old}", f"src/labs/{new}", n=context, lineterm=""
        )
    )


def changed_lines(old: str, new: str) -> tuple[int, int]:
    """(lines removed, lines added) between two labs."""
    lines = lab_diff(old, new, context=0).splitlines()[2:]
    return sum(ln.startswith("-") for ln in lines), sum(
        ln.startswith("+") for ln in lines
    )


def show_lab_diff(old: str, new: str):
    """Display the diff as a highlighted block in a notebook (and in the built book)."""
    from IPython.display import Markdown

    removed, added = changed_lines(old, new)
    return Markdown(
        f"`{old}` → `{new}`: {added} lines added, {removed} "
        f"removed\n\n```diff\n{lab_diff(old, new)}\n```"
    )
