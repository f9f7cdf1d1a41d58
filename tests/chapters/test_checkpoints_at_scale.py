"""What book/checkpoints_at_scale.md does not run: Young's interval on the
fault-tolerance chapter's example and its bad inputs, and the straggler detector's bad
threshold. The page asserts its launch (async_save's snapshot, StateDictOptions rank by
rank, the converters' equal bytes, the detector on fixed times) and the elastic timer's
kill of a hung worker."""

import math

import pytest

from distlab.chapters.checkpoints_at_scale import young_interval
from distlab.tools.stragglers import StragglerDetector


def test_young_interval_and_errors():
    # the fault-tolerance chapter's example: about 54 minutes
    tau, waste = young_interval(60, 86400)
    assert tau == pytest.approx(math.sqrt(2 * 60 * 86400)) and 53 * 60 < tau < 55 * 60
    assert waste == pytest.approx(math.sqrt(2 * 60 / 86400))
    with pytest.raises(ValueError, match="positive"):
        young_interval(0, 86400)
    with pytest.raises(ValueError, match="threshold"):
        StragglerDetector(every=5, threshold=1.0)
