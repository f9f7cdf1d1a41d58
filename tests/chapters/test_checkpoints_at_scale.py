"""What book/checkpoints_at_scale.md does not run: Young's interval on the
fault-tolerance chapter's example and its bad inputs, and the timeline figure on fixed
times. The page asserts its launch (async_save's snapshot, StateDictOptions rank by
rank, the converters' equal bytes)."""

import math

import pytest

from distlab.chapters.checkpoints_at_scale import save_timeline, young_interval


def test_young_interval_and_errors():
    # the fault-tolerance chapter's example: about 54 minutes
    tau, waste = young_interval(60, 86400)
    assert tau == pytest.approx(math.sqrt(2 * 60 * 86400)) and 53 * 60 < tau < 55 * 60
    assert waste == pytest.approx(math.sqrt(2 * 60 / 86400))
    with pytest.raises(ValueError, match="positive"):
        young_interval(0, 86400)


def test_timeline_bars_from_the_times():
    fig = save_timeline({"save": 0.3, "async_blocked": 0.1, "async_total": 0.5})
    widths = sorted(round(p.get_width() * 1000) / 1000 for p in fig.axes[0].patches)
    assert widths == [100.0, 300.0, 400.0]
