"""The house rules of CONTRIBUTING.md that a machine can check: file sizes, names that
tie a page to its code and tests, who may import whom, include markers that exist, names
locked in lab 1, and nothing that points outside the repository. (The lab diff budgets
are in tests/labs/, the frozen model in tests/labs/test_lab1_single.py.)"""

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from distlab.infra.book_build import page_name, read_page, toc_pages
from distlab.infra.paths import LABS_DIR, REPO_ROOT
from support.timing_asserts import timing_assertions, timing_assertions_in

SRC = REPO_ROOT / "src" / "distlab"
MAX_LINES = 400
LANDING_PAGE = "intro"  # the front page: no experiments of its own


def tracked(*patterns: str) -> list:
    out = subprocess.run(
        ["git", "ls-files", *patterns],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return [
        REPO_ROOT / line
        for line in out.stdout.splitlines()
        if (REPO_ROOT / line).is_file()
    ]


def python_files() -> list:
    """Every .py file under src/ and tests/, tracked or new (a file not yet added
    counts too)."""
    return sorted(
        p
        for top in ("src", "tests")
        for p in (REPO_ROOT / top).rglob("*.py")
        if ".venv" not in p.parts
    )


def chapter_pages() -> set[str]:
    return {p.stem for p in (REPO_ROOT / "book").glob("*.md")} - {LANDING_PAGE}


def test_no_python_file_is_over_400_lines():
    long = {
        str(p.relative_to(REPO_ROOT)): n
        for p in python_files()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, (
        f"split these by responsibility (at most {MAX_LINES} lines): {long}"
    )


def test_every_chapter_has_its_module_and_test_file_named_after_it():
    pages = chapter_pages()
    missing_modules = sorted(
        p for p in pages if not (SRC / "chapters" / f"{p}.py").exists()
    )
    missing_tests = sorted(
        p
        for p in pages
        if not (REPO_ROOT / "tests" / "chapters" / f"test_{p}.py").exists()
    )
    assert not missing_modules, (
        f"pages without distlab/chapters/<page>.py: {missing_modules}"
    )
    assert not missing_tests, (
        f"pages without tests/chapters/test_<page>.py: {missing_tests}"
    )


def test_chapter_modules_checkers_and_tests_are_named_after_a_page():
    pages = chapter_pages()
    labs = {p.stem for p in (REPO_ROOT / "labs").glob("*.md")}
    modules = {p.stem for p in (SRC / "chapters").glob("*.py")} - {"__init__"}
    checkers = {p.stem for p in (SRC / "exercises").glob("*.py")} - {
        "__init__",
        "_common",
    }
    tests = {
        p.stem.removeprefix("test_")
        for p in (REPO_ROOT / "tests" / "chapters").glob("test_*.py")
    }
    assert modules <= pages, (
        f"chapter modules with no page of that name: {sorted(modules - pages)}"
    )
    assert checkers <= pages | labs, (
        "exercise checkers with no page of that name: "
        f"{sorted(checkers - pages - labs)}"
    )
    assert tests <= pages, (
        f"chapter test files with no page of that name: {sorted(tests - pages)}"
    )


def test_every_lab_page_has_its_script_and_test_file():
    for page in sorted((REPO_ROOT / "labs").glob("*.md")):
        assert (LABS_DIR / f"{page.stem}.py").exists(), (
            f"labs/{page.name} has no src/labs/{page.stem}.py"
        )
        test = REPO_ROOT / "tests" / "labs" / f"test_{page.stem}.py"
        assert test.exists(), f"labs/{page.name} has no tests/labs/{test.name}"


# who may import whom: the role of a module -> the roles it may import (CONTRIBUTING.md,
# distlab/__init__.py)
LIBRARY = {"library", "costs"}
ALLOWED = {
    "costs": {"costs"},
    "library": LIBRARY,
    "scratch": LIBRARY | {"scratch"},
    "infra": LIBRARY | {"scratch", "infra"},
    "planner": LIBRARY | {"infra", "planner"},
    "tools": LIBRARY | {"infra", "planner", "tools"},
    "figures": LIBRARY | {"scratch", "infra", "planner", "tools", "figures"},
    "chapters": LIBRARY
    | {"scratch", "infra", "planner", "tools", "figures", "chapters"},
    "exercises": LIBRARY
    | {"scratch", "infra", "planner", "tools", "figures", "chapters", "exercises"},
    "bench": LIBRARY
    | {"scratch", "infra", "planner", "tools", "figures", "chapters", "bench"},
}


def role(dotted: str) -> str:
    """distlab.<x>... -> the role of that module ("library" for the root's
    own modules)."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ALLOWED else "library"


def distlab_imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("distlab")
        ):
            names = (
                [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "distlab"
                else [node.module]
            )
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("distlab"))
    return found


def test_each_role_imports_only_what_it_may():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        here = "distlab." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        for target in distlab_imports(path):
            if role(target) not in ALLOWED[role(here)]:
                wrong.append(f"{here} imports {target}")
    for path in sorted(LABS_DIR.glob("*.py")):
        wrong += [
            f"src/labs/{path.name} imports {t}"
            for t in distlab_imports(path)
            if role(t) != "library"
        ]
    assert not wrong, "imports against the roles:\n" + "\n".join(wrong)


INCLUDE = re.compile(r"```\{literalinclude\} (\S+)\n((?::[\w-]+:.*\n)*)")


@pytest.mark.parametrize(
    "page",
    sorted((REPO_ROOT / "book").glob("*.md"))
    + sorted((REPO_ROOT / "labs").glob("*.md")),
    ids=lambda p: p.name,
)
def test_included_code_is_cut_by_markers_that_exist_once(page):
    """The book includes code from src/ by named markers, never by line numbers
    that rot."""
    for target, options in INCLUDE.findall(page.read_text()):
        # Sphinx reads the lab pages through the symlink book/labs: their paths are
        # relative to it
        base = (
            REPO_ROOT / "book" / page.parent.relative_to(REPO_ROOT).name
            if page.parent.name == "labs"
            else page.parent
        )
        source = Path(os.path.normpath(base / target))
        assert source.is_file(), f"{page.name}: {target} does not exist"
        assert ":lines:" not in options, f"{page.name}: {target} is cut by line numbers"
        text = source.read_text()
        for marker in re.findall(r":(?:start-after|end-before): (.+)", options):
            marker = (
                marker.strip().strip("'\"")
                if marker.strip()[0] in "'\""
                else marker.strip()
            )
            count = text.count(marker)
            assert count, f"{page.name}: marker {marker!r} is not in {target}"
            # a named marker cuts one excerpt
            if "--- begin" in marker or "--- end" in marker:
                assert count == 1, (
                    f"{page.name}: marker {marker!r} appears {count} times in {target}"
                )


def test_lab_1_locks_the_names_every_later_lab_uses():
    """STYLE: rank, local_rank, world_size, device and is_main exist even in the
    one-process lab, so no later diff renames them."""
    main = LABS_DIR / "lab1_single.py"
    assigned = {
        target.id
        for node in ast.walk(ast.parse(main.read_text()))
        if isinstance(node, ast.Assign)
        for t in node.targets
        for target in (t.elts if isinstance(t, ast.Tuple) else [t])
        if isinstance(target, ast.Name)
    }
    assert {"rank", "local_rank", "world_size", "device", "is_main"} <= assigned


def test_nothing_in_the_repository_points_outside_it():
    """A fresh clone has nothing beside it: no path that climbs out of the
    repository."""
    outside = re.compile(r"\.\./shared|/work/")
    hits = [
        f"{p.relative_to(REPO_ROOT)}:{i}"
        for p in tracked(
            "*.py", "*.md", "*.yml", "*.toml", "Makefile", ".ci/*", "*.sbatch"
        )
        # this file names the pattern
        if "_vendor" not in p.parts and p != Path(__file__)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert not hits, f"paths outside the repository: {hits}"


def test_no_test_and_no_page_asserts_a_timing():
    """A duration depends on the machine and its load: tests and pages assert the
    deterministic part (errors, bytes, counts, formulas), and timings are recorded
    benchmarks (support/timing_asserts.py says what is flagged, and the opt-out ``#
    timing-ok: <reason>``)."""
    hits = timing_assertions_in(REPO_ROOT / "tests")
    for page in toc_pages():
        for i, cell in enumerate(
            c for c in read_page(page).cells if c.cell_type == "code"
        ):
            hits += timing_assertions(
                TransformerManager().transform_cell(cell.source),
                f"{page_name(page)}, cell {i}",
            )
    assert not hits, (
        "assertions on durations (make them deterministic, or record a benchmark):\n"
        + "\n".join(hits)
    )


@pytest.mark.parametrize(
    "code",
    [
        "assert 1.9 < tour[0]['rank0_only']['waited_s'] < 10",
        "assert all(r['measured_s'] > 1.2 * r['predicted_s'] for r in rows)",
        "assert time.monotonic() - start < 40",
        "assert 0 < summary['mfu'] <= 1",
        "assert node.seconds < 20",
    ],
)
def test_the_timing_rule_flags_assertions_on_durations(code):
    assert timing_assertions(code)


@pytest.mark.parametrize(
    "code",
    [
        # a duration is never negative
        "assert run['tokens_per_s'] > 0 and len(run['step_s']) == 3",
        # a formula on fixed inputs
        "assert costs.tree_s(1e3, 64, a, bw) < costs.ring_s(1e3, 64, a, bw)",
        # a compute figure of a model
        "assert full['time']['compute'] > sharded['time']['compute']",
        "assert waited_s >= 5  # timing-ok: a 5 s timeout cannot fire before "
        "its deadline",
        "assert {'loss', 'step_s'} <= metrics[0].keys()",
    ],
)
def test_the_timing_rule_leaves_deterministic_assertions_and_opt_outs(code):
    assert not timing_assertions(code)
