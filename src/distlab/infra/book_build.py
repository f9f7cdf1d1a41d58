"""Executing the book's pages several at once, before the strict build reads them.

    # the stale pages
    python -m distlab.infra.book_build execute --cache _build/.jupyter_cache
    # slowest first
    python -m distlab.infra.book_build times --cache _build/.jupyter_cache

Jupyter Book 1 executes the pages one after the other, while Sphinx reads them. Most
pages spend their time starting rank processes and waiting on them (imports, rendezvous,
timeouts that a page provokes on purpose), which two cores can overlap. So ``execute``
runs every page whose code cells have no entry in Jupyter Book's execution cache
(jupyter-cache, keyed on the code cells), ``jobs`` pages at a time, each in its own
kernel, and files the executed notebooks in that cache exactly as Jupyter Book would
(``myst_nb.core.execute.cache``). The build that follows, in ``cache`` mode, finds every
page there and executes nothing; a page that failed here is not filed: ``execute``
prints its error and exits 1, and a build run anyway executes it again and reports the
error in the usual way.

Each page runs with ``OMP_NUM_THREADS`` = cores // jobs (at least 1) unless the caller
set it: two pages that each start a thread per core would fight over the cores
(see PLATFORM.md).

``times`` reads the execution time of each page from the same cache, slowest first, and
marks the pages over the budget of CONTRIBUTING.md (``PAGE_BUDGET_S``). It reports; it
asserts nothing (a duration is not a test's business: it depends on the machine and
its load).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import yaml

from distlab.infra.paths import REPO_ROOT

BOOK = REPO_ROOT / "book"
# seconds of execution per page on a 2-core machine (CONTRIBUTING.md)
PAGE_BUDGET_S = 30


def toc_pages() -> list[Path]:
    """The .md files the table of contents names, in reading order (book/<file>.md)."""
    toc = yaml.safe_load((REPO_ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [
        chapter["file"] for part in toc.get("parts", []) for chapter in part["chapters"]
    ]
    return [BOOK / f"{f}.md" for f in files]


def page_name(path: Path) -> str:
    """``single_device``, ``labs/lab1_single``: the page as the table of contents
    names it."""
    return path.relative_to(BOOK).with_suffix("").as_posix()


def book_config() -> dict:
    return yaml.safe_load((REPO_ROOT / "_config.yml").read_text())


def read_page(path: Path):
    """The notebook of a page as myst-nb reads it in the build (the same reader and
    Markdown settings), so that its code cells hash to the key the build looks up in
    the cache."""
    from myst_nb.core.read import read_myst_markdown_notebook
    from myst_parser.config.main import MdParserConfig

    extensions = book_config().get("parse", {}).get("myst_enable_extensions", [])
    config = MdParserConfig(enable_extensions=set(extensions))
    return read_myst_markdown_notebook(
        path.read_text(), config=config, add_source_map=True, path=str(path)
    )


@dataclass
class PageRun:
    page: str
    seconds: float | None  # None: found in the cache, not executed now
    error: str | None = None


def _execute(path: str, timeout: int, log: str) -> tuple[object, float, str | None]:
    """In a worker process: execute one page in its own kernel, in the page's folder
    (the build's ``run_in_temp: false``). The kernel's own stderr (its start-up notices,
    a crash) goes to ``log``. Returns the executed notebook, the seconds, the error."""
    from jupyter_cache.executors.utils import single_nb_execution

    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as stderr:
        os.dup2(stderr.fileno(), 2)  # inherited by the kernel this worker starts
    notebook = read_page(Path(path))
    return run_page(
        lambda: single_nb_execution(
            notebook, cwd=str(Path(path).parent), timeout=timeout, allow_errors=False
        ),
        path,
    )


def run_page(execute, name: str) -> tuple[object, float, str | None]:
    """``execute()`` once, or twice if its kernel died at start ("Kernel died before
    replying to kernel_info": a busy machine, not the page). Any exception becomes the
    page's error, so one page never aborts the build."""
    start = time.monotonic()
    for attempt in (1, 2):
        try:
            result = execute()
            return result.nb, result.time, result.exc_string
        except Exception:  # noqa: BLE001 - the page's error, not the build's
            error = traceback.format_exc()
            if attempt == 1 and "kernel_info" in error:
                print(
                    f"{name}: the kernel died at start; one more try", file=sys.stderr
                )
                continue
            return None, time.monotonic() - start, error


def stale_pages(cache, pages: list[Path]) -> list[Path]:
    """The pages whose code cells have no executed notebook in the cache."""
    stale = []
    for page in pages:
        try:
            cache.match_cache_notebook(read_page(page))
        except KeyError:
            stale.append(page)
    return stale


def execute_pages(
    cache_dir: Path,
    pages: list[Path] | None = None,
    jobs: int | None = None,
    force=False,
    log=print,
):
    """Execute the stale pages (every page with ``force``), ``jobs`` at a time, longest
    first as the cache last timed them, and file each executed notebook in the cache.
    Returns a ``PageRun`` per page executed; a failed page's run carries its traceback.
    """
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(str(cache_dir))
    pages = toc_pages() if pages is None else pages
    todo = pages if force else stale_pages(cache, pages)
    jobs = max(1, jobs or os.cpu_count() or 1)
    last = dict(_timed_uris(cache))
    # longest first: no long page left for the end
    todo = sorted(todo, key=lambda p: -last.get(str(p), 0.0))
    log(
        f"executing {len(todo)} of {len(pages)} pages, {jobs} at a time (cache: "
        f"{cache_dir})"
    )
    if not todo:
        return []
    timeout = int(book_config()["execute"].get("timeout", 900))
    threads = str(max(1, (os.cpu_count() or 1) // min(jobs, len(todo))))
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", threads)  # the workers' kernels inherit it
    runs, start = [], time.monotonic()
    try:
        # spawned workers: nothing of this process's state (threads, open files) is
        # forked into them
        with ProcessPoolExecutor(
            jobs, mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            # each kernel's stderr: <page>.stderr
            logs = Path(cache_dir).parent / "page_logs"
            pending = {
                pool.submit(
                    _execute,
                    str(page),
                    timeout,
                    str(logs / f"{page_name(page)}.stderr"),
                ): page
                for page in todo
            }
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    page = pending.pop(future)
                    notebook, seconds, error = future.result()
                    runs.append(PageRun(page_name(page), seconds, error))
                    if error is None:
                        bundle = CacheBundleIn(
                            notebook, str(page), data={"execution_seconds": seconds}
                        )
                        cache.cache_notebook_bundle(
                            bundle, check_validity=False, overwrite=True
                        )
                    status = "FAILED" if error else "ok"
                    log(
                        f"[{len(runs)}/{len(todo)}] {page_name(page)}: "
                        f"{seconds:.0f} s {status}"
                    )
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    log(f"executed {len(todo)} pages in {time.monotonic() - start:.0f} s")
    return runs


def _timed_uris(cache) -> list[tuple[str, float]]:
    """(uri, seconds) of every cached notebook, oldest first (a later entry wins in
    a dict)."""
    records = sorted(cache.list_cache_records(), key=lambda r: r.created)
    return [
        (r.uri, r.data.get("execution_seconds"))
        for r in records
        if r.data.get("execution_seconds") is not None
    ]


def page_times(
    cache_dir: Path, pages: list[Path] | None = None
) -> list[tuple[str, float | None]]:
    """(page, seconds) for the pages of the book as they are now, slowest first; None
    for a page with no executed notebook of its current code in the cache."""
    from jupyter_cache import get_cache

    cache = get_cache(str(cache_dir))
    times = []
    for page in toc_pages() if pages is None else pages:
        try:
            record = cache.match_cache_notebook(read_page(page))
            times.append((page_name(page), record.data.get("execution_seconds")))
        except KeyError:
            times.append((page_name(page), None))
    return sorted(times, key=lambda t: -(t[1] if t[1] is not None else float("inf")))


def executed_page(cache_dir: Path, page: Path):
    """The page as the build rendered it: its notebook with the cells and outputs of its
    executed notebook in the cache. KeyError if the cache has none for its current code.
    (Not ``jupyter_execute/<page>.ipynb``: for a page found in the cache, myst-nb 1.4
    writes the notebook as read, without execution counts or outputs.)"""
    from jupyter_cache import get_cache

    return get_cache(str(cache_dir)).merge_match_into_notebook(read_page(page))[1]


def times_report(
    times: list[tuple[str, float | None]],
    budget: float = PAGE_BUDGET_S,
    where: str = "",
) -> str:
    """The per-page table a build prints: slowest first, the pages over budget marked.
    ``where`` says how the pages were executed, when not as ``make book`` does (the
    budget's conditions)."""
    known = [s for _, s in times if s is not None]
    lines = [
        "page execution times (the build's critical path), slowest first; "
        f"budget {budget:.0f} s a page"
    ]
    lines += [f"({where})"] if where else []
    for page, seconds in times:
        mark = (
            "not in the cache"
            if seconds is None
            else ("OVER BUDGET" if seconds > budget else "")
        )
        shown = "-" if seconds is None else f"{seconds:5.1f} s"
        lines.append(f"  {shown:>8}  {page}  {mark}".rstrip())
    over = sum(s > budget for s in known)
    lines.append(f"  {sum(known):.0f} s in all, {len(known)} pages, {over} over budget")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.infra.book_build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=["execute", "times"])
    parser.add_argument(
        "--cache",
        type=Path,
        default=REPO_ROOT / "_build" / ".jupyter_cache",
        help="jupyter-cache folder",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="pages at a time (default: the cores)"
    )
    parser.add_argument(
        "--force", action="store_true", help="execute every page, cached or not"
    )
    parser.add_argument(
        "--budget", type=float, default=PAGE_BUDGET_S, help="seconds a page (times)"
    )
    parser.add_argument(
        "pages",
        nargs="*",
        help="pages to execute, as the toc names them (default: all)",
    )
    args = parser.parse_intermixed_args(argv)
    known = {page_name(p): p for p in toc_pages()}
    unknown = [p for p in args.pages if p not in known]
    if unknown:
        parser.error(f"not pages of the table of contents: {', '.join(unknown)}")
    pages = [known[p] for p in args.pages] or None
    if args.command == "times":
        print(times_report(page_times(args.cache, pages), args.budget))
        return 0
    runs = execute_pages(args.cache, pages, args.jobs, args.force)
    failed = [r for r in runs if r.error]
    for run in failed:  # nbclient's report: the cell, then the error
        print(f"\n{run.page} failed:\n{run.error[-4000:]}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(r.page for r in failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
