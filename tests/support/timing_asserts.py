"""Finding assertions on durations in the tests (CONTRIBUTING.md: no timing is asserted
in a test).

A test that asserts how long something took passes or fails with the machine and its
load: a 2-core CI machine running two workers at once is not the developer's laptop. So
an assertion that orders a measured duration, a throughput or an MFU against a bound
(``waited_s < 10``, ``measured_s > 1.2 * predicted_s``, ``time.monotonic() - start <
40``) is a defect: test the deterministic part instead (the error raised, the bytes, the
counts, the formula on fixed inputs), or record the timing as a benchmark with repeats
and spread that a page reads.

A pattern check, on the syntax tree of every ``assert`` under ``tests/``: an ordering
(<, <=, >, >=) one of whose sides names a duration (a name, attribute or string key
ending in ``_s``, ``seconds``, ``elapsed``, ``waited``, ``mfu``, ...; a call of
``time.monotonic`` or the like). Not flagged: comparing with 0 (a duration is never
negative: a sanity check, not a timing); the name of a function called (``ring_s(...)``
is a formula on its inputs); ``len(...)``. The rare justified case says why on the
assert's line: ``# timing-ok: <reason>``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TIMING_NAME = re.compile(
    r"_(?:s|ms|us|ns|sec|secs)$|(?:^|_)(?:seconds|elapsed|duration|durations|waited|wall|latency|speedup|"
    r"throughput|mfu|time|times|timing|timings)$|per_s",
    re.IGNORECASE,
)
CLOCKS = {
    "monotonic",
    "monotonic_ns",
    "perf_counter",
    "perf_counter_ns",
    "time",
    "time_ns",
    "process_time",
}
OPT_OUT = re.compile(r"#\s*timing-ok:\s*\S")
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _timing_names(node: ast.AST) -> list[str]:
    """The names in an expression that say it is a duration: a variable, an attribute or
    a string key, read at its outermost level (``run["time"]["compute"]`` is a
    compute figure)."""
    if isinstance(node, ast.Call):
        func = node.func
        called = (
            func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        )
        if called == "len":
            return []
        found = [f"{called}()"] if called in CLOCKS else []
        return found + [
            n
            for arg in [*node.args, *(k.value for k in node.keywords)]
            for n in _timing_names(arg)
        ]
    if isinstance(node, ast.Name):
        return [node.id] if TIMING_NAME.search(node.id) else []
    if isinstance(node, ast.Attribute):
        return [node.attr] if TIMING_NAME.search(node.attr) else []
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return [repr(key.value)] if TIMING_NAME.search(key.value) else []
        return _timing_names(node.value)
    return [n for child in ast.iter_child_nodes(node) for n in _timing_names(child)]


def _is_zero(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and node.value == 0
        and not isinstance(node.value, bool)
    )


def timing_orderings(test: ast.AST) -> list[str]:
    """The duration names ordered against a bound anywhere in an assert's expression."""
    found = []
    for compare in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
        sides = [compare.left, *compare.comparators]
        for op, left, right in zip(compare.ops, sides, sides[1:]):
            if not isinstance(op, ORDERINGS) or _is_zero(left) or _is_zero(right):
                continue
            found += _timing_names(left) + _timing_names(right)
    return found


def timing_assertions(source: str, filename: str = "<test>") -> list[str]:
    """``file:line: names`` for each assert that orders a duration, without ``#
    timing-ok:``."""
    lines = source.splitlines()
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Assert):
            continue
        names = timing_orderings(node.test)
        span = lines[node.lineno - 1 : node.end_lineno]
        if names and not any(OPT_OUT.search(line) for line in span):
            hits.append(f"{filename}:{node.lineno}: {', '.join(sorted(set(names)))}")
    return hits


def timing_assertions_in(folder: Path) -> list[str]:
    return [
        hit
        for path in sorted(folder.rglob("*.py"))
        for hit in timing_assertions(
            path.read_text(), str(path.relative_to(folder.parent))
        )
    ]
