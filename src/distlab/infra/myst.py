"""A MyST page's source read as the book's checks need it: its fenced blocks (a code
cell, a dropdown, an include) with their options, and the page's file from its name.
One reader for the page anatomy, the reading path and the glue check."""

from __future__ import annotations

import re
from dataclasses import dataclass

from distlab.infra.paths import REPO_ROOT

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\{([\w:-]+)\})?")


@dataclass
class Block:
    """Lines ``first`` to ``last`` (0-based, fences included) of the page."""

    directive: str | None  # "code-cell", "admonition", ...; None for a plain fence
    options: list[str]  # the ``:name: value`` lines
    body: list[str]  # the lines between the fences, options included
    first: int
    last: int

    def has_option(self, pattern: str) -> bool:
        return any(re.match(pattern, o) for o in self.options)


def page_source(page: str) -> str:
    """The source of a page named as _toc.yml names it (``labs/`` pages included)."""
    return (REPO_ROOT / "book" / f"{page}.md").read_text()


def body_lines(source: str) -> list[str]:
    """The page's lines after its front matter."""
    lines = source.splitlines()
    if lines and lines[0].strip() == "---":
        lines = lines[lines.index("---", 1) + 1 :]
    return lines


def blocks(lines: list[str]) -> list[Block]:
    """The top-level fenced blocks of ``lines``; a block ends at the first line that
    is its own fence again (nested blocks use longer fences)."""
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != m.group(1):
            j += 1
        body = lines[i + 1 : j]
        options = [x for x in body if x.startswith(":")]
        if body and body[0].strip() == "---":  # options as a YAML header: tags: [...]
            end = next((k for k in range(1, len(body)) if body[k].strip() == "---"), 0)
            options += [":" + x.strip() for x in body[1:end] if ":" in x]
        found.append(Block(m.group(3), options, body, i, min(j, len(lines) - 1)))
        i = j + 1
    return found
