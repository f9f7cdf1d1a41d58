"""The page anatomy (CONTRIBUTING.md, "The page anatomy"), checked on a built page.

Every page follows one shape: the question and its answer on the first screen with the
page's key figure; the mechanism drawn by code within the first two screens; short code
no wider than the reading column; the evidence folded; Pitfalls, a Summary and
Exercises. What a program can check of that is checked here, on the HTML the build wrote
and on the page's source:

    python -m distlab.infra.page_anatomy _build/html  # the pages that follow it
    python -m distlab.infra.page_anatomy _build/html collectives  # any one page
    python -m distlab.infra.page_anatomy PAGE.html collectives  # a page built alone

prints each page's findings (nothing when it follows the anatomy) and exits 1 on any.
`tests/book/test_page_anatomy.py` runs the same checks on every build of `make test`.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from distlab.infra.myst import blocks, body_lines, page_source

# The pages rebuilt to the anatomy. A page joins when it is rebuilt, and then it stays.
ANATOMY_PAGES = (
    "intro",
    "single_device",
    "collectives",
    "launching",
    "data_parallel",
    "ddp_internals",
    "ddp_overlap",
    "ddp_scaling",
    "ddp_in_practice",
    "ddp_tuning",
    "feeding_ranks",
    "zero_memory",
    "fsdp_scratch",
    "fsdp2",
    "fsdp_communication",
    "fsdp_prefetch_offload",
    "fsdp_big_models",
    "activation_checkpointing",
    "ac_policies",
    "fsdp_compile",
    "checkpoints",
    "checkpoints_at_scale",
    "hangs_and_stragglers",
    "accelerate",
    "accelerate_fsdp2",
    "benchmarks",
    "fault_tolerance",
    "multi_node",
    "debugging",
    "planner",
    "labs/lab1_single",
    "labs/lab2_ddp",
    "labs/lab3_grad_accum",
    "labs/lab4_fsdp2",
    "labs/lab5_activation_ckpt",
    "labs/lab6_accelerate",
)

COLUMNS = 88  # the widest code line a page may show (the reading column holds ~85)
SCREEN_LINES = 28  # lines of text on one desktop screen (1280x900), headings included
FIGURE_WITHIN_LINES = (
    2 * SCREEN_LINES
)  # the first figure starts in the first two screens
UNFOLDED_SOURCE_LINES = 450  # source lines of a page outside folds: one sitting
TITLE_CHARS = 40  # a sidebar entry read at a glance
CLOSING_SECTIONS = ("Pitfalls", "Summary", "Exercises")  # labs: Summary and Exercises

# What the reader sees only on asking: dropdown admonitions and hidden cell inputs
FOLDED_CLASSES = ("dropdown", "toggle-hidden")
WIDGET = "application/vnd.jupyter.widget-view+json"


@dataclass
class Findings:
    page: str
    problems: list[str] = field(default_factory=list)

    def add(self, problem: str) -> None:
        self.problems.append(problem)


def _is_folded(tag) -> bool:
    for parent in [tag, *tag.parents]:
        if parent.name == "details":
            return True
        classes = parent.get("class") or []
        if any(c in FOLDED_CLASSES for c in classes):
            return True
    return False


def _article(html: str):
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    return soup.select_one("article.bd-article") or soup


def wide_code_lines(html: str, columns: int = COLUMNS) -> list[str]:
    """Lines of code and printed output wider than ``columns``, folded or not."""
    wide = []
    for pre in _article(html).find_all("pre"):
        # a diff's first column is its marker (+, - or a space), not the code's
        is_diff = any("highlight-diff" in (p.get("class") or []) for p in pre.parents)
        for line in pre.get_text().splitlines():
            if len(line.rstrip()) > columns + is_diff:
                wide.append(line.rstrip())
    return wide


def _is_figure(tag) -> bool:
    """A figure drawn by code: an image a cell printed, or a widget."""
    if tag.name == "script" and tag.get("type") == WIDGET:
        return True
    if tag.name in ("img", "svg"):
        return any(
            "cell_output" in (p.get("class") or [])
            or "output" in (p.get("class") or [])
            for p in tag.parents
        )
    return False


def lines_before_first_figure(html: str) -> int | None:
    """Rendered lines of unfolded text above the first figure drawn by code (estimated:
    prose at 85 characters a line); None when the page has no such figure unfolded."""
    lines = 0
    counted = ("p", "li", "pre", "h1", "h2", "h3", "h4", "tr", "div")
    for tag in _article(html).find_all(True):
        if _is_folded(tag):
            continue
        if _is_figure(tag):
            return lines
        if tag.name not in counted:
            continue
        if tag.name == "div" and "math" not in (tag.get("class") or []):
            continue
        # a block inside another counted block was counted with it
        if any(p.name in ("p", "li", "pre", "tr") for p in tag.parents):
            continue
        if tag.name == "li" and tag.find("p"):
            continue
        text = tag.get_text()
        if tag.name == "pre":
            lines += len(text.splitlines()) + 1
        elif tag.name in ("h1", "h2", "h3", "h4"):
            lines += 2
        elif tag.name == "tr":
            lines += 1
        elif tag.name == "div":
            lines += 3
        else:
            lines += math.ceil(len(" ".join(text.split())) / 85) + (tag.name == "p")
    return None


# a block the reader sees only on asking: a dropdown, a removed or hidden cell
FOLDED_BLOCK = (
    r":class:.*\bdropdown\b",
    r":tags:.*\b(remove-cell|remove-input|hide-input|hide-cell)\b",
)


def unfolded_source_lines(source: str) -> int:
    """Source lines of a MyST page outside folds: dropdown admonitions, removed or
    hidden cells (their code still runs), and the front matter."""
    lines = body_lines(source)
    folded = sum(
        b.last - b.first + 1
        for b in blocks(lines)
        if any(b.has_option(pattern) for pattern in FOLDED_BLOCK)
    )
    return len(lines) - folded


def check_page(page: str, html: str, source: str) -> Findings:
    found = Findings(page)
    wide = wide_code_lines(html)
    if wide:
        longest = max(wide, key=len)
        found.add(
            f"{len(wide)} code or output line(s) wider than {COLUMNS} columns,"
            f" the widest {len(longest)}: {longest[:60]}..."
        )
    before = lines_before_first_figure(html)
    if before is None:
        found.add("no figure drawn by code outside the folds")
    elif before > FIGURE_WITHIN_LINES:
        found.add(
            f"the first figure starts after ~{before} lines of text, beyond the"
            f" first two screens (~{FIGURE_WITHIN_LINES} lines)"
        )
    n = unfolded_source_lines(source)
    if n > UNFOLDED_SOURCE_LINES:
        found.add(
            f"{n} source lines outside folds (aim: at most {UNFOLDED_SOURCE_LINES})"
        )
    titles = re.findall(r"^# (.+)$", source, flags=re.M)
    if titles and len(titles[0]) > TITLE_CHARS:
        found.add(f"title of {len(titles[0])} characters (at most {TITLE_CHARS})")
    sections = re.findall(r"^## (.+)$", source, flags=re.M)
    wanted = CLOSING_SECTIONS[1:] if page.startswith("labs/") else CLOSING_SECTIONS
    if page != "intro":
        for name in wanted:
            if not any(s.strip().startswith(name) for s in sections):
                found.add(f"no '## {name}' section")
    return found


def check_build(html_dir: Path, pages=ANATOMY_PAGES) -> list[Findings]:
    results = []
    for page in pages:
        html = (Path(html_dir) / f"{page}.html").read_text()
        results.append(check_page(page, html, page_source(page)))
    return results


def main(argv: list[str]) -> int:
    """``HTML_DIR [PAGE...]``, or ``PAGE_FILE.html PAGE``: one page built alone
    (``jupyter-book build book/<page>.md``) is checked as the page it names."""
    if not argv:
        print(__doc__)
        return 2
    where = Path(argv[0])
    if where.is_file():
        if len(argv) != 2:
            print("usage: page_anatomy PAGE_FILE.html PAGE (e.g. labs/lab2_ddp)")
            return 2
        page = argv[1]
        results = [check_page(page, where.read_text(), page_source(page))]
    else:
        results = check_build(where, argv[1:] or ANATOMY_PAGES)
    bad = 0
    for found in results:
        for problem in found.problems:
            print(f"{found.page}: {problem}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
