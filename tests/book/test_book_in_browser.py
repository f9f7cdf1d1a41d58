"""The built book as a reader sees it: every page of the table of contents in
headless Chromium.

One crawl loads every page once, reads it at a desktop and at a phone-sized viewport,
writes a screenshot of each to _build/screenshots/{desktop,phone}/ (or
$DISTLAB_SCREENSHOTS) for a person to look at, opens the first exercise answer, and
records what the browser saw; the per-page tests assert on that record. The controls a
reader drives (search, the stepping widgets, the calculator, the planner form) are
tested in test_book_controls.py.

The build is the strict one of test_notebooks.py, shared through the
`built_book` fixture."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from distlab.infra.book_build import toc_pages
from distlab.infra.page_anatomy import ANATOMY_PAGES
from distlab.infra.paths import REPO_ROOT
from support.browser import (
    DESKTOP,
    PHONE,
    SETTLE,
    visit_all,
)

PAGES = [
    p.relative_to(REPO_ROOT / "book").with_suffix("").as_posix() for p in toc_pages()
]
SCREENSHOTS = Path(
    os.environ.get("DISTLAB_SCREENSHOTS", REPO_ROOT / "_build" / "screenshots")
)

# Waiting for the other xdist worker's book build counts against a test's setup.
pytestmark = pytest.mark.timeout(2400)


# What the per-page tests need beyond the generic record: the last section's heading,
# and each diff's line counts, colours and header.
_FACTS = r"""() => {
  const headings = Array.from(document.querySelectorAll("article section > h2"));
  const colour = (e) => e ? getComputedStyle(e).color : null;
  return {
    last_heading: headings.length ? headings[headings.length - 1].textContent.replace("#", "").trim() : null,
    diffs: Array.from(document.querySelectorAll("div.highlight-diff")).map(d => ({
      added: d.querySelectorAll("span.gi").length,
      removed: d.querySelectorAll("span.gd").length,
      text_colour: colour(d.querySelector("pre")),
      added_colour: colour(d.querySelector("span.gi")),
      removed_colour: colour(d.querySelector("span.gd")),
      header: d.innerText.split("\n").slice(0, 2),
    })),
  };
}"""  # noqa: E501 (a data string: HTML or JavaScript)


def page_facts(page) -> dict:
    """Run on each crawled page after its screenshots: _FACTS, then open the first
    exercise answer the way a reader does, by clicking it."""
    facts = page.evaluate(_FACTS)
    section = page.locator(
        "article section", has=page.locator("h2", has_text="Exercises")
    ).last
    answers = section.locator(".dropdown")
    facts["answers"] = answers.count()
    facts["solutions"] = section.locator("details.above-input").evaluate_all(
        "ds => ds.map(d => ({open: d.open, summary: "
        "d.querySelector('summary').innerText.trim(),"
        " output: (d.parentElement.querySelector('.cell_output') || {innerText: "
        "''}).innerText}))"
    )
    if facts["answers"]:
        body = answers.first.locator("> :not(.admonition-title)").first
        facts["answer_hidden_before"] = not body.is_visible()
        answers.first.locator(".admonition-title").first.click()
        try:
            body.wait_for(state="visible", timeout=5_000)
        except PlaywrightTimeout:
            pass
        facts["answer_visible_after"] = body.is_visible()
    # at desktop width, code blocks and outputs whose lines run past their box
    page.set_viewport_size(DESKTOP)
    page.evaluate(SETTLE)
    facts["cut_code"] = page.evaluate(_CUT_CODE)
    return facts


# Each code block or printed output wider than its box at this width: its first line
# that is cut, and by how many pixels.
_CUT_CODE = """() => Array.from(document.querySelectorAll("article pre"))
  .filter(p => p.scrollWidth > p.clientWidth + 1)
  .map(p => [p.textContent.split("\\n").sort((a, b) => b.length - a.length)[0],
             p.scrollWidth - p.clientWidth])"""


@pytest.fixture(scope="module")
def crawl(site):
    """Every page, loaded once and read at both viewports: {page: {"desktop": Visit,
    "phone": Visit, "facts": page_facts(...)}}."""
    base, _, _ = site
    return visit_all(
        base,
        PAGES,
        {"desktop": DESKTOP, "phone": PHONE},
        SCREENSHOTS,
        inspect=page_facts,
    )


@pytest.mark.parametrize("page", ANATOMY_PAGES)
def test_no_code_is_cut_at_the_column_edge_on_a_desktop(crawl, page):
    """The anatomy's 88 columns fit the reading column of a desktop screen: no code
    block or output of a rebuilt page scrolls sideways at 1280 px (distlab.css sets
    the code size that makes them fit)."""
    cut = crawl[page]["facts"]["cut_code"]
    assert not cut, f"cut at the column edge (line, pixels over): {cut[:3]}"


@pytest.mark.parametrize("page", PAGES)
def test_page_loads_without_errors(crawl, page):
    # loading, resizing and opening an answer, all views together
    v = crawl[page]["desktop"]
    assert not v.page_errors, f"uncaught JavaScript exceptions: {v.page_errors}"
    assert not v.console_errors, f"console errors: {v.console_errors}"
    assert not v.failed_requests, f"failed requests: {v.failed_requests}"


@pytest.mark.parametrize("page", PAGES)
def test_page_makes_no_request_beyond_localhost(crawl, page):
    """Widgets, math and fonts are served by the book (book/_vendor), never by a CDN."""
    outside = crawl[page]["desktop"].outside_requests
    assert not outside, f"requests that would leave 127.0.0.1: {sorted(set(outside))}"


@pytest.mark.parametrize("page", PAGES)
def test_every_image_loads(crawl, page):
    v = crawl[page]["desktop"]
    assert not v.broken_images, f"images that did not load: {v.broken_images}"


def _ids_of(html: Path, path: str, crawl) -> set[str]:
    """The element ids of a built page: from the browser for crawled pages, else from
    the file."""
    page = path.removesuffix(".html")
    if page in crawl:
        return crawl[page]["desktop"].ids
    text = (html / path).read_text(errors="replace")
    return set(re.findall(r'\bid="([^"]+)"', text)) | set(
        re.findall(r'\bname="([^"]+)"', text)
    )


@pytest.mark.parametrize("page", PAGES)
def test_internal_links_and_anchors_resolve(site, crawl, page):
    base, html, _ = site
    broken = []
    for link in sorted(set(crawl[page]["desktop"].links)):
        if not link.startswith(base):
            continue  # a link to another site: not followed (the tests run offline)
        parts = urlsplit(link)
        path = parts.path.removeprefix(urlsplit(base).path) or "index.html"
        if path.endswith("/"):
            path += "index.html"
        if not (html / path).is_file():
            broken.append(f"{link}: no such file")
        elif (
            parts.fragment
            and path.endswith(".html")
            and parts.fragment not in _ids_of(html, path, crawl)
        ):
            broken.append(f"{link}: no element with id {parts.fragment!r}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES)
def test_page_is_readable_on_a_phone(crawl, page):
    """At 390 CSS pixels the page does not scroll sideways (wide code and tables scroll
    inside their own box), the text column takes the screen (the navigation folds away),
    and the text keeps a readable size."""
    v = crawl[page]["phone"]
    assert v.scroll_width <= v.viewport_width + 1, (
        f"{v.scroll_width}px wide at a {v.viewport_width}px viewport; sticking "
        f"out: {v.wide_elements}"
    )
    assert v.article_width >= 0.8 * v.viewport_width, (
        f"the text column is {v.article_width:.0f}px wide"
    )
    assert v.text_px >= 14, f"body text of {v.text_px}px"


def test_a_screenshot_of_every_page_at_both_sizes(crawl):
    for view in ("desktop", "phone"):
        for page in PAGES:
            # as browser.visit names them
            shot = SCREENSHOTS / view / f"{page.replace('/', '-')}.png"
            # not a blank image
            assert shot.is_file() and shot.stat().st_size > 10_000, shot


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p.startswith("labs/") and p != "labs/lab1_single"]
)
def test_the_diff_from_the_previous_lab_renders(crawl, page):
    """Each lab page shows its diff as a highlighted diff: added and removed lines in
    colours of their own, file names relative to the repository."""
    diffs = crawl[page]["facts"]["diffs"]
    assert diffs, "no highlighted diff on the page"
    d = diffs[0]
    assert d["added"] > 0 and d["removed"] > 0, d
    assert d["text_colour"] not in (d["added_colour"], d["removed_colour"]), d
    assert d["header"][0].startswith("--- src/labs/") and d["header"][1].startswith(
        "+++ src/labs/"
    ), d["header"]


@pytest.mark.parametrize("page", PAGES)
def test_page_ends_with_exercises_whose_answers_open_on_demand(crawl, page):
    facts = crawl[page]["facts"]
    assert facts["last_heading"] == "Exercises", facts["last_heading"]
    assert facts["answers"] > 0, "no answer to open"
    assert facts["answer_hidden_before"], (
        "the first answer is shown before it is opened"
    )
    assert facts["answer_visible_after"], "clicking the first answer did not open it"


# The pages whose exercises ask for code, each with a checker (distlab.exercises).
CODE_EXERCISES = {
    "collectives": 1,
    "ddp_overlap": 1,
    "ddp_in_practice": 1,
    "ddp_tuning": 1,
    "fsdp_scratch": 2,
    "fsdp_prefetch_offload": 1,
    "fsdp_big_models": 1,
    "activation_checkpointing": 1,
    "planner": 1,
    "ac_policies": 1,
    "fsdp_compile": 1,
    "accelerate": 1,
    "accelerate_fsdp2": 1,
    "fault_tolerance": 1,
    "debugging": 1,
    "labs/lab2_ddp": 1,
}


@pytest.mark.parametrize("page", CODE_EXERCISES)
def test_code_exercises_hide_a_solution_that_passes_its_checker(crawl, page):
    """The reference solution of each code exercise is folded away, and the build ran it
    through the exercise's checker: its output is the checker's "passed" line."""
    solutions = crawl[page]["facts"]["solutions"]
    assert len(solutions) == CODE_EXERCISES[page], solutions
    for solution in solutions:
        assert solution["summary"] == "Show the solution" and not solution["open"], (
            solution
        )
        assert solution["output"].startswith("passed:"), solution
