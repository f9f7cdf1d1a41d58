"""The built book in a real browser: serve `_build/html` on 127.0.0.1, drive Debian's
Chromium with playwright, and record what a reader's browser would see on each page.

`visit()` loads one page and returns a `Visit`: console errors, uncaught exceptions,
every request that tried to leave 127.0.0.1 (stopped before it leaves, and recorded),
requests that failed, images that did not load, the page's links and element ids, and
how wide the page is against the viewport. The tests in test_book_in_browser.py assert
on these."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

# Chromium's own background traffic (updates, sync, field trials) is off, so every
# request the tests see comes from the page (the flags Debian's Chromium needs headless,
# as root, offline).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}  # an iPhone 14's CSS pixels
LOAD_TIMEOUT_MS = 120_000  # a bound against a hang, not a measure of speed
QUIET_S = 0.5  # no request in flight for this long: the page's network has gone quiet
LOAD_TRIES = 2  # a page whose network never goes quiet is loaded afresh once


def chromium_path() -> str:
    """The browser `make test` installed (or the one its CHROMIUM variable names)."""
    path = os.environ.get("DISTLAB_CHROMIUM", "/usr/bin/chromium")
    if not os.access(path, os.X_OK):
        raise RuntimeError(
            f"no Chromium at {path}: `make test` installs Debian's chromium, or run "
            "`make test CHROMIUM=/path/to/chrome` (playwright's own browser "
            "download is not used)"
        )
    return path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the test output
        pass


class _Server(http.server.ThreadingHTTPServer):
    # socketserver's default backlog of 5 is less than the connections the crawl's
    # browsers open at once (3 Chromiums, up to 6 each to one host); a connection past
    # the backlog is dropped and retried by TCP after 1, 3, 7, ... seconds
    request_queue_size = 128


@contextlib.contextmanager
def serve(folder: Path):
    """Serve `folder` over HTTP on a free port of 127.0.0.1 (port 0: the kernel picks
    one, so two test runs at once never collide); yields the base URL, ending in '/'."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Visit:
    url: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    broken_images: list[str] = field(default_factory=list)
    images: int = 0
    links: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    scroll_width: int = 0
    viewport_width: int = 0
    wide_elements: list[str] = field(default_factory=list)
    article_width: float = 0  # CSS pixels of the page's main text column
    text_px: float = 0  # font size of its first paragraph


# Everything the tests read from a loaded page, in one round trip. `width` is the
# viewport's width as set: on a phone the browser zooms out to fit content wider than
# the screen (so innerWidth grows with it), and what sticks out is what a reader has to
# scroll sideways to.
_READ_PAGE = r"""(width) => {
  const images = Array.from(document.images);
  const clipped = (e) => {  // inside a box that scrolls or clips its own overflow
    for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
      if (getComputedStyle(a).overflowX !== "visible") return true;
    return false;
  };
  const sticksOut = (e) => {  // partly past the right edge; drawers parked off-screen don't count
    const r = e.getBoundingClientRect();
    return r.right > width + 1 && r.left < width && !clipped(e)
      && !["absolute", "fixed"].includes(getComputedStyle(e).position);
  };
  const wide = Array.from(document.querySelectorAll("body *")).filter(
    e => sticksOut(e) && !(e.parentElement && sticksOut(e.parentElement)));
  const describe = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "")
    + (typeof e.className === "string" && e.className ? "." + e.className.trim().split(/\s+/).join(".") : "")
    + ": " + JSON.stringify((e.textContent || "").trim().slice(0, 40));
  const article = document.querySelector("article"), paragraph = document.querySelector("article p");
  return {
    broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.currentSrc || i.src),
    images: images.length,
    links: Array.from(document.querySelectorAll("a[href]")).map(a => a.href),
    ids: Array.from(document.querySelectorAll("[id]")).map(e => e.id)
         .concat(Array.from(document.querySelectorAll("a[name]")).map(a => a.name)),
    scrollWidth: document.documentElement.scrollWidth,
    articleWidth: article ? article.getBoundingClientRect().width : 0,
    textPx: paragraph ? parseFloat(getComputedStyle(paragraph).fontSize) : 0,
    wide: document.documentElement.scrollWidth > width + 1 ? wide.slice(0, 5).map(describe) : [],
  };
}"""  # noqa: E501 (a data string: HTML or JavaScript)


# Wait for the CSS transitions and finite animations running now to finish.
SETTLE = """() => Promise.all(document.getAnimations()
  .filter(a => a.effect && a.effect.getComputedTiming().iterations !== Infinity)
  .map(a => a.finished.catch(() => null)))"""


def is_local(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("data", "blob", "about") or parts.hostname == "127.0.0.1"


# What the page still does after its `load` event besides fetching (the fetches, the
# widgets' require.js modules among them, are waited for by _wait_until_quiet):
# MathJax's typesetting, the fonts. Waits for both, at most `ms`; returns what had not
# finished.
_READY = """(ms) => Promise.race([
  (async () => {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise)
      await MathJax.startup.promise;
    await document.fonts.ready;
    return [];
  })(),
  new Promise(done => setTimeout(() => done([
    ...(window.MathJax && MathJax.startup ? ["MathJax typesetting"] : []),
    ...(document.fonts.status === "loading" ? ["fonts"] : [])]), ms))])"""


class Unsettled(Exception):
    """A page that was still fetching, or typesetting, when its time was up."""


def visit(
    context,
    url: str,
    views: dict[str, dict],
    screenshots: Path | None = None,
    inspect=None,
) -> dict:
    """Load `url` in a new tab of `context` (a playwright BrowserContext) and record it
    at each viewport of `views` ({"desktop": {"width": .., "height": ..}, ...}; the page
    is resized, not reloaded), with a screenshot of each in `screenshots/<view>/`.
    Requests for other hosts are aborted, so a test run never depends on the network.
    `inspect(page)`, if given, runs last and its result is returned under "facts".
    Returns {view: Visit, "facts": ...}.

    The page is read once its network has gone quiet: no request in flight for
    QUIET_S, counted on the requests the page makes. (Playwright's own "networkidle"
    twice never came in 120 s, once on CI, in about ten runs of the suite, and said
    nothing of why; Playwright's documentation discourages it.) A page
    still fetching after LOAD_TIMEOUT_MS is loaded afresh in a new tab, with a warning
    that names what it was waiting for; after LOAD_TRIES, the error names it."""
    stalls = []
    for _ in range(LOAD_TRIES):
        try:
            seen = _visit_once(context, url, views, screenshots, inspect)
        except Unsettled as e:
            stalls.append(str(e))
            continue
        for stall in stalls:
            warnings.warn(f"{url} loaded afresh: {stall}", stacklevel=2)
        return seen
    raise RuntimeError(
        f"{url} never settled in {LOAD_TRIES} tries: " + "; ".join(stalls)
    )


def _wait_until_quiet(page, in_flight: dict, last_change: list[float]) -> None:
    """Poll until no request of `page` has been in flight for QUIET_S; raise
    Unsettled naming the requests still in flight after LOAD_TIMEOUT_MS."""
    deadline = time.monotonic() + LOAD_TIMEOUT_MS / 1000
    while in_flight or time.monotonic() - last_change[0] < QUIET_S:
        if time.monotonic() > deadline:
            now = time.monotonic()
            pending = [f"{r.url} (for {now - t:.0f} s)" for r, t in in_flight.items()]
            raise Unsettled(
                f"{len(pending)} requests in flight after {LOAD_TIMEOUT_MS // 1000} s: "
                + ", ".join(pending[:5])
            )
        page.wait_for_timeout(100)  # also lets playwright deliver the request events


def _visit_once(context, url, views, screenshots, inspect) -> dict:
    page = context.new_page()
    errors = Visit(url)  # what happens while loading belongs to every view
    in_flight = {}  # request: when it started
    last_change = [time.monotonic()]

    def started(r):
        in_flight[r] = time.monotonic()
        last_change[0] = time.monotonic()

    def ended(r):
        in_flight.pop(r, None)
        last_change[0] = time.monotonic()

    page.on("request", started)
    page.on("requestfinished", ended)
    page.on("requestfailed", ended)

    def route(r):
        if is_local(r.request.url):
            r.continue_()
        else:
            errors.outside_requests.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on(
        "console",
        lambda m: (
            m.type == "error"
            and errors.console_errors.append(
                f"{m.text} "
                f"({m.location.get('url', '')}:{m.location.get('lineNumber', '')})"
            )
        ),
    )
    page.on("pageerror", lambda e: errors.page_errors.append(str(e)))
    page.on(
        "requestfailed",
        lambda r: (
            is_local(r.url) and errors.failed_requests.append(f"{r.url}: {r.failure}")
        ),
    )
    page.on(
        "response",
        lambda r: (
            r.status >= 400
            and errors.failed_requests.append(f"{r.url}: HTTP {r.status}")
        ),
    )
    seen = {}
    try:
        page.set_viewport_size(next(iter(views.values())))
        # generous: the crawl runs beside the rest of the suite on 2 busy cores, where
        # a page with widgets and MathJax once took over 30 s to settle
        page.goto(url, wait_until="load", timeout=LOAD_TIMEOUT_MS)
        typesetting = page.evaluate(_READY, LOAD_TIMEOUT_MS)
        if typesetting:
            raise Unsettled(f"still waiting for {', '.join(typesetting)}")
        _wait_until_quiet(page, in_flight, last_change)
        for view, size in views.items():
            page.set_viewport_size(size)
            # the sidebars slide when the width crosses a breakpoint
            page.evaluate(SETTLE)
            read = page.evaluate(_READ_PAGE, size["width"])
            record = Visit(
                url,
                errors.console_errors,
                errors.page_errors,
                errors.outside_requests,
                errors.failed_requests,
                read["broken"],
                read["images"],
                read["links"],
                set(read["ids"]),
                read["scrollWidth"],
                size["width"],
                read["wide"],
                read["articleWidth"],
                read["textPx"],
            )
            seen[view] = record
            if screenshots is not None:
                shot = (
                    screenshots
                    / view
                    / (
                        urlsplit(url)
                        .path.strip("/")
                        .removesuffix(".html")
                        .replace("/", "-")
                        + ".png"
                    )
                )
                shot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(shot))
        seen["facts"] = inspect(page) if inspect else None
    finally:
        page.close()
    return seen


def visit_all(
    base: str,
    pages: list[str],
    views: dict[str, dict],
    screenshots: Path | None,
    inspect,
    workers: int = 3,
):
    """`visit()` every page of `pages` (paths under `base`, without ".html"), on
    `workers` browsers at once; returns {page: visit's result}, in the order of `pages`.

    A visit is mostly waiting (for the network to go quiet, for MathJax and the
    widgets), not computing, so browsers side by side finish sooner: the book's 35 pages
    took 67 s in one browser and 48 s in three on 2 cores (four were no faster: by then
    the cores are busy). Playwright's sync API must stay in the thread that started it,
    so each thread starts its own Playwright and Chromium."""
    from concurrent.futures import ThreadPoolExecutor

    from playwright.sync_api import sync_playwright

    def visit_share(share: list[str]) -> dict:
        seen = {}
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=chromium_path(), args=CHROMIUM_ARGS
            )
            try:
                context = browser.new_context()
                for page in share:
                    try:
                        seen[page] = visit(
                            context,
                            f"{base}{page}.html",
                            views,
                            screenshots,
                            inspect=inspect,
                        )
                    except Exception as e:  # say which page: every browser test fails
                        raise RuntimeError(f"visiting {page}: {e}") from e
            finally:
                browser.close()
        return seen

    shares = [pages[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        results = {
            page: seen
            for share in pool.map(visit_share, shares)
            for page, seen in share.items()
        }
    return {page: results[page] for page in pages}
