"""Shared test set-up: the CPU pin, the xdist schedule and the book build.
Helpers that tests import live in support/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from distlab.infra.book_build import execute_pages, times_report
from distlab.infra.paths import REPO_ROOT


def pytest_configure(config):
    """Pin the suite to the CPU, on a machine with GPUs too, unless the run selects the
    GPU tests.

    ``DISTLAB_DEVICE=cpu`` makes every ``pick_device("auto")`` the CPU, in this process,
    the ranks it launches and the book build's kernels, and the empty
    ``CUDA_VISIBLE_DEVICES`` hides the GPUs from all of them: the CPU suite gives the
    same results on any machine (on GPUs, "auto" would switch the ranks to NCCL, which
    the gloo tests do not expect). Set here, before any test module is imported, so
    nothing has asked CUDA anything yet. ``pytest -m gpu`` (the mark expression then
    names ``gpu`` without ``not``) keeps the GPUs visible.
    """
    # The xdist workers share the cores: a thread per core in each would make them fight
    # over the cores (PLATFORM.md: 2 threads per process on 2 cores ran about 3x
    # slower). torch reads this when it is first imported, which no test module has done
    # yet; the ranks a test launches and the book build's kernels inherit it. (The
    # controller sets it first, from -n, and its workers inherit it.)
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(
        config.option, "numprocesses", None
    )
    workers = int(workers) if str(workers).isdigit() and int(workers) > 0 else 1
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers))
    )
    expression = config.option.markexpr or ""
    if "gpu" in expression and "not gpu" not in expression:
        return
    os.environ["DISTLAB_DEVICE"] = "cpu"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session", autouse=True)
def _environment():
    """No progress bars in test output (nothing is cached: each run times its
    own peak)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    yield


# The files whose tests read the book build. Under `make test` (xdist, --dist loadfile)
# they must run on one worker, one after the other: the other worker would otherwise
# take one of them early and sit blocked for the whole build (xdist hands out the files
# with the most tests first). Not xdist_group: --dist loadgroup silently stops grouping
# with pytest 9.2.
BOOK_FILES = (
    "test_notebooks.py",
    "test_page_anatomy.py",
    "test_book_in_browser.py",
    "test_book_controls.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of BOOK_FILES scheduled as one file."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class BookFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "the book build" if scope.rsplit("/", 1)[-1] in BOOK_FILES else scope

    return BookFilesTogether(config, log)


def pytest_collection_modifyitems(items):
    """The book's tests first: the strict build they share is the longest task of the
    suite, so under xdist the worker that takes this file must start it before anything
    else; the browser tests, which read that build, follow it."""
    order = {
        "test_notebooks.py": 0,
        "test_page_anatomy.py": 1,
        "test_book_in_browser.py": 2,
        "test_book_controls.py": 3,
    }
    # stable: keeps the rest in order
    items.sort(key=lambda item: order.get(item.path.name, 4))


# Pages executed at a time before the build reads them (distlab.infra.book_build): the
# other xdist worker runs the rest of the suite meanwhile, so two pages at once keep
# both cores busy.
BOOK_JOBS = 2


@pytest.fixture(scope="session")
def built_book(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The README's book command, strict (`jupyter-book build book -W -n --keep-going`),
    run once per test run into a fresh folder; the notebook and browser tests read what
    it built. Returns the finished process and the build folder (html/,
    jupyter_execute/).

    Every page is executed from scratch: first `BOOK_JOBS` at a time into the build's
    own, new execution cache (`distlab.infra.book_build`, what `make book` does), then
    the build reads them from there, so nothing cached by an earlier run can pass. A
    page that failed is executed again by the build, which reports its error as it
    always does.

    Under xdist each worker is its own process with its own session fixtures, so the
    build is shared through a folder both workers see, under a file lock: the first
    worker to ask builds, the other waits for it and reads the same result."""
    reuse = os.environ.get("DISTLAB_REUSE_BUILD")
    # working on the page tests: read a finished build (the strict-build test
    # then fails)
    if reuse:
        return subprocess.CompletedProcess(["reused", reuse], 0, "", ""), Path(reuse)
    shared = _run_folder(tmp_path_factory)
    out, record = shared / "book", shared / "book.json"
    with FileLock(str(shared / "book.lock"), timeout=2400):
        if not record.exists():
            # where the build looks (myst-nb's default)
            cache = out / "_build" / ".jupyter_cache"
            log = []
            runs = execute_pages(cache, jobs=BOOK_JOBS, force=True, log=log.append)
            jupyter_book = Path(sys.executable).parent / "jupyter-book"
            proc = subprocess.run(
                [
                    str(jupyter_book),
                    "build",
                    "book",
                    "-W",
                    "-n",
                    "--keep-going",
                    "--path-output",
                    str(out),
                ],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            done = {
                "args": proc.args,
                "returncode": proc.returncode,
                "stdout": proc.stdout,
                "stderr": proc.stderr,
            }
            times = {r.page: r.seconds for r in runs}
            # a page that failed here and passed when the build ran it again is a flaky
            # page: its error is kept for the test that counts the cached pages
            errors = {r.page: r.error[-4000:] for r in runs if r.error}
            record.write_text(
                json.dumps(
                    {
                        **done,
                        "executed": "\n".join(log),
                        "page_times": times,
                        "page_errors": errors,
                    }
                )
            )
    done = json.loads(record.read_text())
    return subprocess.CompletedProcess(
        **{k: done[k] for k in ("args", "returncode", "stdout", "stderr")}
    ), out / "_build"


def _run_folder(tmp_path_factory) -> Path:
    """The folder of this test run that every xdist worker (and the controller) sees."""
    base = tmp_path_factory.getbasetemp()
    # a worker's basetemp is its own
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def pytest_terminal_summary(terminalreporter, config):
    """After the results: how long each page took to execute in this run's book build,
    slowest first, against the budget of CONTRIBUTING.md (the build is the suite's
    critical path)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not hasattr(
        config, "_tmp_path_factory"
    ):
        return
    record = _run_folder(config._tmp_path_factory) / "book.json"
    if record.exists():
        times = json.loads(record.read_text()).get("page_times", {})
        terminalreporter.write_sep("=", "the book build")
        where = (
            f"executed {BOOK_JOBS} at a time beside the rest of the suite, so "
            "slower than `make book`, "
            "whose conditions the budget is for"
        )
        terminalreporter.write_line(
            times_report(sorted(times.items(), key=lambda t: -t[1]), where=where)
        )


@pytest.fixture(scope="session")
def site(built_book):
    """The strict build served on 127.0.0.1 and a headless Chromium: (base URL, html
    folder, playwright Browser), for the browser tests."""
    from playwright.sync_api import sync_playwright

    from support.browser import CHROMIUM_ARGS, chromium_path, serve

    proc, build = built_book
    if proc.returncode != 0:
        pytest.fail(
            "the strict book build failed; see "
            "test_strict_build_passes_and_writes_every_page"
        )
    html = build / "html"
    with serve(html) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium_path(), args=CHROMIUM_ARGS
        )
        try:
            yield base, html, browser
        finally:
            browser.close()
