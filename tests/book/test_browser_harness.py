"""The crawl's wait for a page to settle (support.browser.visit), on pages made to
stall: it reads a page only once its last request has finished, loads a page afresh
when a request hangs, and names the request when it hangs every time.

The pages are served by a small server of this file, not the book's build, so these
run in seconds and without the `built_book` fixture."""

from __future__ import annotations

import contextlib
import http.server
import re
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import browser

# Fetched after the `load` event, so only the quiet-network wait can see it; its
# answer is written into the page.
PAGE = b"""<!doctype html><html><body><p id="out">waiting</p><script>
addEventListener("load", () => setTimeout(() => fetch("/answer")
  .then(r => r.text()).then(t => { document.getElementById("out").textContent = t; }),
  200));
</script></body></html>"""


@contextlib.contextmanager
def stalling_server(hangs: int, delay_s: float = 0.0):
    """Serve PAGE at /page.html; /answer hangs (until the server stops) on its first
    `hangs` requests, then answers "answered" after `delay_s`."""
    release = threading.Event()
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/answer":
                asked.append(self.path)
                if len(asked) <= hangs:
                    release.wait()
                    return
                release.wait(delay_s)
                body, kind = b"answered", "text/plain"
            else:
                body, kind = PAGE, "text/html"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/page.html", asked
    finally:
        release.set()
        server.shutdown()
        server.server_close()


pytestmark = pytest.mark.timeout(180)


def visit_in_own_browser(url: str, inspect=None):
    """browser.visit(url) in a Chromium of its own, started in a thread of its own as
    the crawl's are (the `site` fixture may hold this thread's Playwright); returns
    (its result, or the exception it raised, and the warnings it gave)."""
    from playwright.sync_api import sync_playwright

    def run():
        with warnings.catch_warnings(record=True) as caught, sync_playwright() as pw:
            warnings.simplefilter("always")
            chromium = pw.chromium.launch(
                executable_path=browser.chromium_path(), args=browser.CHROMIUM_ARGS
            )
            try:
                seen = browser.visit(
                    chromium.new_context(),
                    url,
                    {"desktop": browser.DESKTOP},
                    inspect=inspect,
                )
            except RuntimeError as e:
                seen = e
            finally:
                chromium.close()
        return seen, [str(w.message) for w in caught]

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setattr(browser, "LOAD_TIMEOUT_MS", 3_000)


def text_of_out(page):
    return page.inner_text("#out")


def test_a_page_is_read_after_its_last_request_finished():
    """The answer comes 1.5 s after the `load` event; the record holds it, from the
    first load."""
    with stalling_server(hangs=0, delay_s=1.5) as (url, asked):
        seen, warned = visit_in_own_browser(url, inspect=text_of_out)
    assert seen["facts"] == "answered"
    assert (len(asked), warned) == (1, [])


def test_a_request_that_hangs_once_is_loaded_afresh_with_a_warning():
    with stalling_server(hangs=1) as (url, asked):
        seen, warned = visit_in_own_browser(url, inspect=text_of_out)
    assert seen["facts"] == "answered"
    assert len(asked) == 2
    assert len(warned) == 1
    assert re.search(r"loaded afresh: 1 requests in flight .*/answer", warned[0])


def test_a_request_that_always_hangs_is_named_in_the_error():
    with stalling_server(hangs=browser.LOAD_TRIES) as (url, asked):
        error, _ = visit_in_own_browser(url)
    assert isinstance(error, RuntimeError)
    assert re.search(r"never settled in 2 tries: .*/answer \(for \d+ s\)", str(error))
    assert len(asked) == browser.LOAD_TRIES
