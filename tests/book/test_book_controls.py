"""The book's controls, driven in headless Chromium as a reader drives them, with no
Python kernel behind the built HTML: search, every stepping widget, the memory
calculator and the planner form.

The build is the strict one of test_notebooks.py, shared through the `built_book`
fixture; `site` (conftest) serves it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from support.browser import DESKTOP

# Waiting for the other xdist worker's book build counts against a test's setup.
pytestmark = pytest.mark.timeout(2400)


@pytest.fixture
def tab(site):
    base, _, browser = site
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.route(
        "**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort()
    )
    page.base = base
    yield page
    context.close()


def test_search_finds_a_term(tab):
    """Sphinx's search runs in the browser on the index the build wrote: the chapter
    about the term comes first, and the other pages that use it follow."""
    tab.goto(f"{tab.base}search.html?q=fully_shard")
    results = tab.locator("#search-results ul.search li a")
    expect(results.first).to_have_attribute(
        "href", re.compile(r"^fsdp2\.html"), timeout=15_000
    )
    # more than a handful of pages use fully_shard
    expect(results.nth(4)).to_be_attached()
    # Sphinx adds the results one by one, on timers: wait for lab 4's, do not read the
    # list once (a CI run read it after 6 results and failed)
    expect(
        tab.locator('#search-results ul.search li a[href^="labs/lab4_fsdp2.html"]')
    ).to_be_attached(timeout=15_000)


def stepping_widget_pages(html: Path) -> list[str]:
    """The pages whose widgets step through a mechanism (a Play linked to a slider)."""
    return sorted(
        str(p.relative_to(html).with_suffix(""))
        for p in html.rglob("*.html")
        if '"_model_name": "PlayModel"' in p.read_text()
    )


def test_every_stepping_widget_steps_without_a_kernel(site, tab):
    """Each page's stepping widget (Play, slider, stacked views, linked in the browser
    with jslink) works in the built HTML with no Python behind it: the slider moves the
    shown view, Play moves the slider, and nothing throws. (The theme's FontAwesome once
    replaced Play's icon, so Play threw and stopped the links: widgets-setup.js, 3.)"""
    _, html, _ = site
    pages = stepping_widget_pages(html)
    assert len(pages) >= 4, f"too few stepping widgets found: {pages}"
    errors = []
    tab.on("pageerror", lambda e: errors.append(f"{tab.url}: {e}"))
    for page in pages:
        tab.goto(f"{tab.base}{page}.html")
        widget = tab.locator(".widget-vbox", has=tab.locator(".widget-play")).first
        slider = widget.locator(".widget-slider").first
        expect(slider).to_be_visible(timeout=15_000)
        # a Stack shows one child
        stack = widget.locator(".widget-box:not(.widget-hbox)").last
        before = stack.inner_html()
        readout = slider.locator(".widget-readout")
        shown = readout.inner_text()
        handle = slider.locator(".noUi-handle")
        # a widget may open on its last view (every bucket fired): step back then
        at_end = handle.get_attribute("aria-valuenow") == handle.get_attribute(
            "aria-valuemax"
        )
        handle.focus()
        tab.keyboard.press("ArrowLeft" if at_end else "ArrowRight")
        expect(readout).not_to_have_text(shown)
        # the view shown changed (views may be images only: compare the markup)
        tab.wait_for_function(
            "([el, before]) => el.innerHTML !== before",
            arg=[stack.element_handle(), before],
            timeout=5_000,
        )
        shown = readout.inner_text()
        widget.locator(".widget-play button").first.click()
        expect(readout).not_to_have_text(shown, timeout=10_000)
    assert not errors, errors


def test_memory_calculator_answers_as_the_python_functions_do(tab):
    """The zero_memory chapter's calculator is plain HTML and JavaScript: change the
    form and the table changes, to what `distlab.tools.memory_calculator.estimate` says.
    """
    from distlab.infra.tables import format_bytes
    from distlab.tools.memory_calculator import estimate

    tab.goto(f"{tab.base}zero_memory.html")
    calc = tab.locator("#distlab-memcalc")
    expect(calc).to_be_visible()
    total = calc.locator(".out tr", has_text="total per rank")
    first = total.inner_text()
    calc.locator("select[name=model]").select_option("paper_7.5b")
    calc.locator("select[name=dtype]").select_option("bf16_mixed")
    calc.locator("select[name=optimizer]").select_option("adamw")
    calc.locator("select[name=strategy]").select_option("fsdp2")
    calc.locator("input[name=ranks]").fill("64")
    expected = estimate("paper_7.5b", 64, "bf16_mixed", strategy="fsdp2")
    expect(total).to_contain_text(format_bytes(expected["total"]))
    assert total.inner_text() != first
    calc.locator("input[name=ranks]").fill("0")
    expect(calc.locator(".out")).to_contain_text("ranks N must be a whole number")


def test_planner_form_answers_as_the_python_planner_does(tab):
    """The capstone's planner form runs without a kernel and shows the answer
    `planner.calibrate.predict_range` gives for the chosen plan."""
    from distlab.planner.form import answer

    tab.goto(f"{tab.base}planner.html")
    form = tab.locator("#distlab-planner")
    speed = form.locator(".speed")
    first = speed.inner_text()
    choice = {"model": "llama3-70b", "ac": "full", "cluster": "512/ib-400g"}
    for name, value in choice.items():
        form.locator(f"select[name={name}]").select_option(value)
    chosen = {
        name: form.locator(f"select[name={name}]").input_value()
        for name in ("model", "gpu", "cluster", "strategy", "ac", "micro_batch")
    } | {"seq_len": form.locator("select[name=seq_len]").input_value()}
    mem_lo, mem, mem_hi, fits, lo, mid, hi = answer(chosen)
    assert fits  # 70B with full checkpointing fits 512 GPUs
    expect(speed).to_contain_text(f"{mid:,} ({lo:,} to {hi:,})")
    expect(form.locator(".verdict")).to_contain_text(f"{mem:g} GiB")
    assert speed.inner_text() != first
    form.locator("select[name=model]").select_option("gpt2-xl")
    expect(form.locator(".out")).to_contain_text("longer than gpt2-xl's 1024 positions")
