"""What FSDP2 sends: the page (book/fsdp_communication.md) runs every variant and every
switch on 4 gloo ranks in one launch and asserts on every build what they count (the
bytes per collective kind and group, gloo's doubled reduce-scatter, the dtype knobs, the
switches' skipped collectives and their gradients). Here: Psi, the textbook's formula
away from N=4, and the drawing code on calls made up by hand."""

import math

import matplotlib

from distlab.chapters.fsdp_communication import (
    VARIANTS,
    parameter_bytes,
    textbook_psi,
)
from distlab.figures import who_sends
from distlab.infra.experiment import gpt
from distlab.model import count_parameters
from distlab.tools.collective_bytes import Call

matplotlib.use("Agg")


def test_psi_counts_every_parameter_once_the_tied_matrix_included():
    model = gpt("tiny")
    assert model.lm_head.weight is model.wte.weight  # one matrix, two uses
    assert parameter_bytes(model) == 4 * count_parameters(model)  # fp32


def test_the_textbook_formula_tends_to_the_papers_2_and_3_psi():
    n = 10**6
    assert math.isclose(textbook_psi("DDP", n), 2, rel_tol=1e-5)
    assert math.isclose(textbook_psi("ZeRO-3 (FSDP2 True)", n), 3, rel_tol=1e-5)
    assert textbook_psi("ZeRO-2-like (FSDP2 False)", 8) == textbook_psi("DDP", 8)
    assert all(textbook_psi(name, 4) > 0 for name in VARIANTS)


# HSDP on (2, 2), as rank 0 counts it: a gather and a scatter in its row, an
# all-reduce of the half-size shard down its column
HSDP_RANK0 = {
    "psi": 400,
    "phases": {
        "forward": [Call("all-gather", 400, 2, (0, 1))],
        "backward": [
            Call("all-gather", 200, 2, (0, 1)),
            Call("all-gather", 200, 2, (0, 1)),
            Call("reduce-scatter", 400, 2, (0, 1)),
            Call("all-reduce", 200, 2, (0, 2)),
        ],
        "step": [],
    },
}


def test_segments_sum_the_calls_of_one_phase_kind_and_group():
    assert who_sends.segments(HSDP_RANK0) == [
        ("forward", "all-gather", (0, 1), 0.5),
        ("backward", "all-gather", (0, 1), 0.5),
        ("backward", "reduce-scatter", (0, 1), 0.5),
        ("backward", "all-reduce", (0, 2), 0.5),
    ]
    assert who_sends.sent_psi(HSDP_RANK0) == 2.0


def test_the_group_figure_draws_one_ring_per_group_and_kind():
    rank1 = {**HSDP_RANK0, "phases": {
        "forward": [Call("all-gather", 400, 2, (0, 1))],
        "backward": [Call("all-reduce", 200, 2, (1, 3))],
        "step": [],
    }}  # fmt: skip
    fig = who_sends.group_figure([HSDP_RANK0, rank1], "HSDP (2x2 mesh)")
    forward, backward, step = fig.axes
    assert len(forward.lines) == 1  # one group, one kind
    assert len(backward.lines) == 4  # (0, 1) twice, (0, 2) and (1, 3)
    assert not step.lines
