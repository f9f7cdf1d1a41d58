"""Each lab is the previous one plus one feature: the book shows the real diff,
generated from the files, and these budgets keep it readable (STYLE: about 40 changed
lines per step). The budgets count lines at 88 columns, where a call or an import
list that once fit one line takes several."""

import re

import pytest

from distlab.infra.labdiff import changed_lines, lab_diff


@pytest.mark.parametrize(
    "old,new,budget",
    [
        # DDP: process group, wrapper, loss all-reduces, and the docstring's torchrun
        # launch lines
        ("lab1_single.py", "lab2_ddp.py", 80),
        ("lab2_ddp.py", "lab3_grad_accum.py", 80),
        ("lab3_grad_accum.py", "lab4_fsdp2.py", 80),
        ("lab4_fsdp2.py", "lab5_activation_ckpt.py", 50),
        # lab 6 is lab 5's plumbing rewritten on Accelerate, not one feature more: a
        # bigger diff, about lab 5's own distance from lab 1 plus the launcher checks
        # (lab 5's FSDP2 comments it drops)
        ("lab5_activation_ckpt.py", "lab6_accelerate.py", 180),
    ],
)
def test_lab_diffs_stay_small(old, new, budget):
    removed, added = changed_lines(old, new)
    assert removed + added <= budget, (
        f"{old} -> {new}: {removed} removed, {added} added"
    )


def test_checkpointing_is_lab_1s_so_lab_2_adds_only_ddp():
    """Checkpoint and resume live in lab 1, the baseline every lab inherits: the lab 1
    -> lab 2 diff has no checkpoint option, no Checkpoints object and no start step."""
    changed = lab_diff("lab1_single.py", "lab2_ddp.py", context=0).splitlines()[2:]
    pattern = re.compile(
        r"Checkpoints\(|start_step|checkpoint_every:|keep_checkpoints:|resume:"
    )
    assert not [line for line in changed if pattern.search(line)]
