"""What book/hangs_and_stragglers.md does not run: the straggler detector's bad
threshold, and the figure's colours on a fixed report. The page asserts its launch
(the detector on live and fixed times) and the elastic timer's kill of a hung worker."""

import pytest

from distlab.chapters.hangs_and_stragglers import straggler_figure
from distlab.tools.stragglers import StragglerDetector


def test_bad_threshold():
    with pytest.raises(ValueError, match="threshold"):
        StragglerDetector(every=5, threshold=1.0)


def test_figure_marks_the_flagged_rank():
    report = {"own_s": [[0.001, 0.002], [0.031, 0.032]], "slow_ranks": [1]}
    fig = straggler_figure(report)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["rank 0", "rank 1 (flagged)"]
    assert lines[1].get_ydata()[0] == pytest.approx(31.0)
