"""Timings repeated, and the sentences worded from them.

A page is built on a shared 2-core machine, two pages at a time, beside a test suite: a
single timing there can land anywhere. So a sentence that states a direction or a ratio
from a live timing is never written into the page's prose with the numbers glued in. It
is worded here, from repeated samples, with a guard: when the data have the shape the
sentence claims, the page says so with the numbers; when they do not, the page says that
this run could not show it and why (the machine's load), and points to the recorded
benchmark that does. Recorded benchmarks use the same `spread` and `compare`.

    a, b = repeat(lambda: step(plain), 5), repeat(lambda: step(bucketed), 5)
    glue("bucket_claim", shaped(
        compare(a, b) == "slower",
        f"Bucketing cut the step from {ms(a)} to {ms(b)} (median of 5).",
        "that bucketing cuts the step",
    ), display=False)  # claim: the sentence is the glue

The rule is in CONTRIBUTING.md ("Live numbers"); `tests/book/test_claims.py` checks that
a comparative sentence of a page glues only values marked as worded here, recorded, or
exact.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence


def spread(values: Sequence[float]) -> dict:
    """Each repeat, their median, min and max."""
    values = list(values)
    if not values:
        raise ValueError("spread() of no values")
    return {
        "repeats": values,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def compare(a, b) -> str:
    """``a`` against ``b`` (two lists of samples, or two `spread` dicts): "larger" or
    "smaller" only when their ranges (min to max) do not overlap; else "within noise".
    One sample each is never enough: that is "within noise" too."""
    a = a if isinstance(a, dict) else spread(a)
    b = b if isinstance(b, dict) else spread(b)
    if len(a.get("repeats", [0, 0])) < 2 or len(b.get("repeats", [0, 0])) < 2:
        return "within noise"
    if a["min"] > b["max"]:
        return "larger"
    if a["max"] < b["min"]:
        return "smaller"
    return "within noise"


def repeat(fn: Callable[[], object], times: int) -> list[float]:
    """Seconds of ``times`` calls of ``fn``, one sample each."""
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def load_note() -> str:
    """The machine's load as a reader can check it: "load average 3.1 on 2 cores"."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on every platform
        return f"{os.cpu_count()} cores"
    return f"load average {load:.1f} on {os.cpu_count()} cores"


def shaped(holds: bool, sentence: str, showing: str, recorded: str = "") -> str:
    """``sentence`` when the data show what it claims (``holds``); otherwise a sentence
    that says this run could not show ``showing`` on this machine, with its load, and
    where the recorded evidence is (``recorded``, e.g. "the recorded benchmark below").
    """
    if holds:
        return sentence
    where = f"; {recorded} shows it" if recorded else ""
    return f"This build's run was too noisy to show {showing} ({load_note()}){where}."
