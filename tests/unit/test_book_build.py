"""``run_page``: a kernel that dies at start gets one more try; any other failure is the
page's error and never aborts the build."""

from types import SimpleNamespace

from distlab.infra.book_build import run_page

DIED = "Kernel died before replying to kernel_info"


def attempts(*outcomes):
    """An ``execute`` that raises or returns each outcome in turn, and counts calls."""
    calls = []

    def execute():
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return execute, calls


def test_a_kernel_that_died_at_start_is_started_once_more():
    done = SimpleNamespace(nb="notebook", time=1.5, exc_string=None)
    execute, calls = attempts(RuntimeError(DIED), done)
    assert run_page(execute, "page") == ("notebook", 1.5, None)
    assert len(calls) == 2


def test_a_kernel_that_dies_twice_is_the_pages_error():
    execute, calls = attempts(RuntimeError(DIED), RuntimeError(DIED))
    notebook, _, error = run_page(execute, "page")
    assert notebook is None and DIED in error
    assert len(calls) == 2


def test_any_other_exception_is_the_pages_error_without_a_retry():
    execute, calls = attempts(ValueError("bad cell source"))
    notebook, _, error = run_page(execute, "page")
    assert notebook is None and "ValueError: bad cell source" in error
    assert len(calls) == 1
