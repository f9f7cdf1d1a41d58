"""The landing page's reading path: the pages a learner reads in order, the pages a
practitioner comes back to, and how long each takes to read.

    rows = reading_path()  # every page of _toc.yml but the root, classified
    rows["core"][0]  # Row(page="single_device", title=..., minutes=..., ...)
    print(path_tables(rows))  # the two Markdown tables book/intro.md shows

Which page is on the core path, and in which order, is an editorial choice: the
lists below. The pages themselves come from the table of contents (``_toc.yml``), so a
page added there appears on the landing page, and a page that is in neither list stops
the build (and ``tests/unit/test_reading_path.py``) with a message that says where to
add it.

Reading time (``READING_RULE``): the words of prose outside folds at 200 words a
minute, plus half a minute for each block of code or output shown outside folds (a
figure is a cell's output), rounded to the nearest minute, at least 1. What a dropdown,
a removed cell or a hidden cell holds is not counted: a first read skips it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from distlab.infra.myst import blocks, body_lines
from distlab.infra.paths import REPO_ROOT

WORDS_PER_MINUTE = 200
MINUTES_PER_BLOCK = 0.5  # a code block, an output or a figure shown outside folds
READING_RULE = (
    f"prose outside folds at {WORDS_PER_MINUTE} words a minute, plus "
    f"{MINUTES_PER_BLOCK * 60:.0f} s for each block of code, output or figure shown"
)

# The core path, in reading order, with the question each page answers: the
# foundations, data parallelism's essentials, sharding's essentials, then the labs.
# A page named here that the table of contents lacks is left out if it is in
# MAY_BE_ABSENT (a page being written), and is an error otherwise.
CORE_PATH: dict[str, str] = {
    "single_device": "What does one training step cost in bytes and FLOPs?",
    "collectives": "How do processes exchange tensors, and what does it cost?",
    "launching": "How are the ranks started: mp.spawn, torchrun?",
    "ddp_internals": "What does DDP do to the gradients, and when?",
    "feeding_ranks": "How does each rank get its own share of the data?",
    "zero_memory": "Where do the bytes of training go, and what can sharding cut?",
    "fsdp_scratch": "How does sharding work, built by hand?",
    "fsdp2": "How do I shard a model with `fully_shard`?",
    "activation_checkpointing": "How do I trade compute for activation memory?",
    "labs/lab1_single": "The reference run every lab must match",
    "labs/lab2_ddp": "Lab 1 plus DDP",
    "labs/lab3_grad_accum": "Lab 2 plus gradient accumulation",
    "labs/lab4_fsdp2": "Lab 3 with FSDP2 instead of DDP",
    "labs/lab5_activation_ckpt": "Lab 4 plus activation checkpointing",
    "labs/lab6_accelerate": "The same run through Hugging Face Accelerate",
}
MAY_BE_ABSENT = {"launching"}

# The pages a practitioner comes back to, with what they come back for.
REFERENCE: dict[str, str] = {
    "data_parallel": "Should I still use `nn.DataParallel`?",
    "ddp_overlap": "Is the all-reduce hidden behind backward? Can it send less?",
    "ddp_scaling": "How small can each GPU's batch get before scaling breaks?",
    "ddp_in_practice": "My ranks have uneven data, or BatchNorm",
    "ddp_tuning": "Which DDP flags? What learning rate as ranks are added?",
    "fsdp_communication": "How many bytes does FSDP2 move per step?",
    "fsdp_prefetch_offload": "Is the next all-gather early enough? Does offload pay?",
    "fsdp_big_models": "The model does not fit on one rank, even to build it",
    "checkpoints": "How do I save and load a sharded model?",
    "checkpoints_at_scale": "My saves stall training, or I need another format",
    "hangs_and_stragglers": "A worker hangs, or one rank is slow",
    "ac_policies": "Which activations should I keep, and which recompute?",
    "fsdp_compile": "Does `torch.compile` work with FSDP2?",
    "accelerate": "Is Accelerate really running what I asked for?",
    "accelerate_fsdp2": "What does each `fsdp_config` key do?",
    "fault_tolerance": "A rank died: how do I resume exactly?",
    "multi_node": "How do I run on several machines, or under SLURM?",
    "debugging": "My job hangs, or the ranks disagree",
    "benchmarks": "Which strategy is fastest, at what memory?",
    "planner": "Will my run fit, and how fast will it go?",
}


class UnclassifiedPage(ValueError):
    """A page of the table of contents that the reading path does not place, or a
    placed page that the table of contents lacks."""


@dataclass(frozen=True)
class Row:
    page: str  # as _toc.yml names it: "single_device", "labs/lab1_single"
    title: str  # the page's "# " heading
    question: str  # what it answers (CORE_PATH) or what one comes back for
    minutes: int  # reading time, by READING_RULE
    part: str  # the caption of its part in _toc.yml


def toc_parts(toc_file: Path = REPO_ROOT / "_toc.yml") -> tuple[str, dict[str, str]]:
    """The root page, and every other page of the table of contents with the caption
    of its part, in reading order."""
    toc = yaml.safe_load(toc_file.read_text())
    parts = {
        chapter["file"]: part.get("caption", "")
        for part in toc.get("parts", [])
        for chapter in part["chapters"]
    }
    return toc["root"], parts


def page_file(page: str, book: Path = REPO_ROOT / "book") -> Path:
    """The source of a page named as _toc.yml names it (book/labs is a link to
    labs/)."""
    return book / f"{page}.md"


def page_title(source: str) -> str:
    match = re.search(r"^# (.+)$", source, flags=re.M)
    if not match:
        raise ValueError("the page has no '# ' title")
    return match.group(1).strip()


_FOLDED_CELL = re.compile(r":tags:.*\b(remove-cell|hide-cell)\b")
_DROPDOWN = re.compile(r":class:.*\bdropdown\b")
# directives whose body is code shown to the reader
_CODE_DIRECTIVES = {"code-cell", "literalinclude", "code-block", "code", "sourcecode"}


def reading_counts(source: str) -> tuple[int, int]:
    """(words of prose, blocks of code or output) of a MyST page outside its folds:
    dropdowns and removed or hidden cells are skipped, a shown cell, an included
    file and a fenced code block count as one block each, and the body of any other
    directive (a note, a tab) is read as prose."""
    lines = body_lines(source)
    found = blocks(lines)
    inside = {k for b in found for k in range(b.first, b.last + 1)}
    words = sum(
        sum(1 for w in line.split() if re.search(r"\w", w))
        for k, line in enumerate(lines)
        # a colon fence or a label is markup, not prose
        if k not in inside
        and not line.lstrip().startswith(":::")
        and not re.match(r"^\(.+\)=$", line)
    )
    shown = 0
    for block in found:
        if block.has_option(_FOLDED_CELL) or block.has_option(_DROPDOWN):
            continue
        if block.directive is None or block.directive in _CODE_DIRECTIVES:
            shown += 1
            continue
        # another directive: its body is prose (its own nested blocks included)
        inner = "\n".join(x for x in block.body if not x.startswith(":"))
        more_words, more_blocks = reading_counts(inner)
        words, shown = words + more_words, shown + more_blocks
    return words, shown


def reading_minutes(source: str) -> int:
    """The time to read a page, by ``READING_RULE``."""
    words, blocks = reading_counts(source)
    return max(1, round(words / WORDS_PER_MINUTE + blocks * MINUTES_PER_BLOCK))


def classify(pages: list[str]) -> tuple[list[str], list[str]]:
    """The core path (in its editorial order) and the reference pages (in the order
    of the table of contents) among ``pages``; ``UnclassifiedPage`` names a page that
    is in neither list, or in both, or listed but missing from the table of contents.
    """
    both = set(CORE_PATH) & set(REFERENCE)
    if both:
        raise UnclassifiedPage(
            f"{', '.join(sorted(both))}: in both CORE_PATH and REFERENCE of "
            "src/distlab/infra/reading_path.py; keep each page in one"
        )
    unplaced = [p for p in pages if p not in CORE_PATH and p not in REFERENCE]
    if unplaced:
        raise UnclassifiedPage(
            f"{', '.join(unplaced)}: in _toc.yml but not on the reading path; add each "
            "to CORE_PATH (in reading order) or REFERENCE in "
            "src/distlab/infra/reading_path.py, with the question it answers"
        )
    missing = [
        p for p in [*CORE_PATH, *REFERENCE] if p not in pages and p not in MAY_BE_ABSENT
    ]
    if missing:
        raise UnclassifiedPage(
            f"{', '.join(missing)}: on the reading path but not in _toc.yml; remove "
            "it from src/distlab/infra/reading_path.py (or add it to MAY_BE_ABSENT)"
        )
    core = [p for p in CORE_PATH if p in pages]
    return core, [p for p in pages if p in REFERENCE]


def reading_path(
    toc_file: Path = REPO_ROOT / "_toc.yml", book: Path = REPO_ROOT / "book"
) -> dict[str, list[Row]]:
    """``{"core": [...], "reference": [...]}``: a ``Row`` per page of the table of
    contents but its root (the landing page, which shows the path)."""
    _, parts = toc_parts(toc_file)
    core, reference = classify(list(parts))

    def row(page: str, questions: dict[str, str]) -> Row:
        source = page_file(page, book).read_text()
        return Row(
            page,
            page_title(source),
            questions[page],
            reading_minutes(source),
            parts[page],
        )

    return {
        "core": [row(p, CORE_PATH) for p in core],
        "reference": [row(p, REFERENCE) for p in reference],
    }


def _link(row: Row) -> str:
    return f"[{row.title}]({row.page}.md)"


def path_tables(rows: dict[str, list[Row]]) -> dict[str, str]:
    """The core path and the reference pages as two Markdown tables (MyST: the links
    are to the pages' sources, relative to book/)."""
    core = ["| | read | it answers | min |", "|--:|---|---|--:|"]
    core += [
        f"| {i} | {_link(r)} | {r.question} | {r.minutes} |"
        for i, r in enumerate(rows["core"], 1)
    ]
    reference = ["| part | page | come back for | min |", "|---|---|---|--:|"]
    parts = [r.part for r in rows["reference"]]
    reference += [
        # each part named on its first row only
        f"| {r.part if i == 0 or parts[i - 1] != r.part else ''} | {_link(r)} "
        f"| {r.question} | {r.minutes} |"
        for i, r in enumerate(rows["reference"])
    ]
    return {"core": "\n".join(core), "reference": "\n".join(reference)}


def total_minutes(rows: list[Row]) -> int:
    return sum(r.minutes for r in rows)
