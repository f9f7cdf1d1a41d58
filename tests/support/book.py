"""The pages of the book, as the table of contents lists them."""

from __future__ import annotations

from pathlib import Path

import yaml

from distlab.infra.paths import REPO_ROOT


def toc_pages() -> list[Path]:
    """The .md files the table of contents names, in reading order (book/<file>.md)."""
    toc = yaml.safe_load((REPO_ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return [REPO_ROOT / "book" / f"{f}.md" for f in files]
