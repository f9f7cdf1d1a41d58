"""Live numbers cannot contradict the prose (CONTRIBUTING.md, "Live numbers").

On the pages that follow the anatomy, every `glue(...)` says what its value is, with a
comment at the end of the call: ``# exact`` (a count, bytes, a shape, a formula on fixed
inputs: the same on every machine), ``# recorded`` (read from a recorded benchmark in
``results/``, with its repeats and provenance), ``# claim`` (a whole sentence worded by
``distlab.infra.claims.shaped`` from repeated samples, with its guard) or ``# live`` (a
timing of this build). A sentence of the prose that states a direction or a ratio may
not glue a ``live`` value: on a loaded 2-core builder it can land anywhere.
"""

from __future__ import annotations

import re

import pytest

from distlab.infra.myst import blocks, page_source
from distlab.infra.page_anatomy import ANATOMY_PAGES

KINDS = ("exact", "recorded", "claim", "live")
COMPARATIVE = re.compile(
    r"\b(faster|slower|quicker|longer|shorter|more|less|fewer|twice|half|times|ratio"
    r"|speed-?ups?|slow-?downs?|overlap\w*|sav(es|ed|ing)|beats?|wins?|outruns?"
    r"|costs? (more|less)|\d+(\.\d+)?x)\b|×",
    re.I,
)
GLUE_REF = re.compile(r"\{glue(?::\w*)?\}`([^`]+)`")


def split_cells(source: str) -> tuple[list[str], str]:
    """The code of the page's code cells, and its prose (everything else)."""
    lines = source.splitlines()
    cells = [b for b in blocks(lines) if b.directive == "code-cell"]
    inside = {k for b in cells for k in range(b.first, b.last + 1)}
    prose = "\n".join(line for k, line in enumerate(lines) if k not in inside)
    return ["\n".join(b.body) for b in cells], prose


def glue_kinds(code_cells: list[str]) -> tuple[dict[str, str], list[str]]:
    """Each glued name's kind, and the glue calls that carry no kind."""
    kinds, unmarked = {}, []
    for cell in code_cells:
        lines = cell.splitlines()
        for i, line in enumerate(lines):
            m = re.search(r"\bglue\(\s*f?[\"']([^\"']+)[\"']", line)
            if not m:
                continue
            # the call may run over several lines: its kind is on the line that closes
            # it
            depth, j = 0, i
            for j in range(i, len(lines)):
                code = lines[j].split("#", 1)[0]
                depth += code.count("(") - code.count(")")
                if depth <= 0 and j >= i:
                    break
            statement = "\n".join(lines[i : j + 1])
            mark = re.search(r"#\s*(exact|recorded|claim|live)\b", lines[j])
            if not mark:
                unmarked.append(statement.strip())
                continue
            kind = mark.group(1)
            if kind == "claim" and "shaped(" not in statement:
                unmarked.append(f"{statement.strip()}  <- a claim is made by shaped()")
            kinds[m.group(1)] = kind
    return kinds, unmarked


def sentences(prose: str) -> list[str]:
    prose = re.sub(r"\s+", " ", prose)
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(`{])", prose)


def problems(source: str) -> list[str]:
    code, prose = split_cells(source)
    kinds, unmarked = glue_kinds(code)
    found = [f"glue without its kind ({'/'.join(KINDS)}): {s}" for s in unmarked]
    for sentence in sentences(prose):
        names = GLUE_REF.findall(sentence)
        if not names or not COMPARATIVE.search(sentence):
            continue
        for name in names:
            kind = kinds.get(name)
            if kind == "live" or kind is None:
                where = kind or "not glued on the page"
                found.append(
                    f"a comparative sentence glues {name!r} ({where}): {sentence[:160]}"
                )
    return found


@pytest.mark.parametrize("page", ANATOMY_PAGES)
def test_no_comparative_sentence_rests_on_a_live_timing(page):
    found = problems(page_source(page))
    assert not found, "\n".join(found)


BROKEN = """
```{code-cell} ipython3
glue("speedup", f"{a / b:.1f}", display=False)  # live
glue("buckets", str(n), display=False)  # exact
glue("plain", f"{t:.1f}", display=False)
```

DDP made the step {glue:text}`speedup` times faster with {glue:text}`buckets` buckets.
"""


def test_the_check_catches_a_live_ratio_and_an_unmarked_glue():
    found = problems(BROKEN)
    assert any("'speedup' (live)" in f for f in found), found
    assert any("glue without its kind" in f and "plain" in f for f in found), found
    assert not any("'buckets'" in f for f in found), found
