"""The hang-diagnosis data that the debugging page draws and prints as its checklist
(``distlab.tools.triage``): what the page's figure cannot show going wrong."""

import matplotlib

matplotlib.use("Agg")

from distlab.tools.triage import TRIAGE, checklist, triage_figure  # noqa: E402


def test_every_drawn_label_fits_its_box():
    # a longer line overflows the box, or shrinks the figure's text on a phone
    for branch in TRIAGE:
        for text in (branch.seen, branch.means, branch.tool):
            assert max(len(line) for line in text.split("\n")) <= 16, text


def test_the_checklist_has_the_timeout_first_then_one_step_a_row():
    steps = checklist().splitlines()
    assert len(steps) == len(TRIAGE) + 1
    assert steps[0].startswith("1. Make it fail instead of hang")
    assert [s.split(". ", 1)[1] for s in steps[1:]] == [b.step for b in TRIAGE]


def test_the_figure_draws_one_box_per_row_and_column():
    fig = triage_figure(TRIAGE[:2])
    assert len(fig.axes[0].patches) == 2 * 3
