"""The page anatomy (CONTRIBUTING.md), checked on what the build wrote: code no wider
than the reading column, the mechanism drawn by code in the first two screens, the
evidence folded (the unfolded source short enough for one sitting), a short sidebar
title, and Pitfalls, Summary and Exercises. `distlab.infra.page_anatomy` holds the
checks; `python -m distlab.infra.page_anatomy _build/html` runs them on a local build.
"""

import pytest

from distlab.infra.myst import page_source
from distlab.infra.page_anatomy import (
    ANATOMY_PAGES,
    check_page,
    lines_before_first_figure,
    unfolded_source_lines,
    wide_code_lines,
)


@pytest.mark.parametrize("page", ANATOMY_PAGES)
def test_page_follows_the_anatomy(page, built_book):
    _, build = built_book
    html = (build / "html" / f"{page}.html").read_text()
    found = check_page(page, html, page_source(page))
    assert not found.problems, "\n".join(found.problems)


def test_the_checks_catch_a_wide_line_a_late_figure_and_a_long_unfolded_page():
    prose = "<p>" + "word " * 400 + "</p>"
    figure = '<div class="cell_output"><img src="x.png"></div>'
    wide = "<pre>" + "x" * 89 + "\n" + "y" * 88 + "</pre>"
    page = f'<article class="bd-article">{prose * 12}{figure}{wide}</article>'
    assert wide_code_lines(page) == ["x" * 89]
    # a diff's marker column is not code: 88 columns of code show at 89
    diff = (
        '<div class="highlight-diff"><pre>+'
        + "x" * 88
        + "\n-"
        + "y" * 89
        + "</pre></div>"
    )
    assert wide_code_lines(f'<article class="bd-article">{diff}</article>') == [
        "-" + "y" * 89
    ]
    assert lines_before_first_figure(page) > 56
    # the same figure first, and the text folded in a dropdown, pass
    early = (
        f'<article class="bd-article">{figure}<details>{prose * 12}</details></article>'
    )
    assert lines_before_first_figure(early) == 0
    # a hand-placed image outside any cell output is not a figure drawn by code
    assert (
        lines_before_first_figure('<article class="bd-article"><img></article>') is None
    )
    folded = "```{admonition} How\n:class: dropdown\n" + "x\n" * 500 + "```\n"
    assert unfolded_source_lines("# T\n" + folded) == 1
    assert unfolded_source_lines("# T\n" + "x\n" * 500) == 501
