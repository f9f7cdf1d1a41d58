"""distlab.infra.claims: repeated samples compared by their ranges, and the guard that
words a page's sentence only when the data show it."""

import pytest

from distlab.infra.claims import compare, load_note, repeat, shaped, spread


def test_spread_keeps_every_repeat_and_its_median_and_range():
    s = spread([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["repeats"]) == (2.0, 1.0, 3.0, [3, 1, 2])
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_compare_calls_a_difference_only_when_the_ranges_do_not_overlap():
    assert compare([5.0, 6.0, 7.0], [1.0, 2.0, 3.0]) == "larger"
    assert compare([1.0, 2.0], [5.0, 6.0]) == "smaller"
    assert compare([1.0, 4.0], [3.0, 6.0]) == "within noise"
    # one sample each is never a difference, however far apart
    assert compare([100.0], [1.0]) == "within noise"
    # spread dicts work as well as lists
    assert compare(spread([5.0, 6.0]), spread([1.0, 2.0])) == "larger"


def test_a_sentence_is_said_only_when_its_shape_holds():
    said = shaped(True, "Buckets were faster.", "that buckets are faster")
    assert said == "Buckets were faster."
    guarded = shaped(
        False, "Buckets were faster.", "that buckets are faster", "the benchmark"
    )
    assert "Buckets were faster" not in guarded
    assert "too noisy to show that buckets are faster" in guarded
    assert "the benchmark shows it" in guarded and "cores" in guarded
    assert "cores" in load_note()


def test_repeat_returns_one_duration_per_call():
    calls = []
    samples = repeat(lambda: calls.append(1), 4)
    assert len(samples) == 4 and len(calls) == 4
    assert all(s >= 0 for s in samples)
