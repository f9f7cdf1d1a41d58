"""The learning-rate rules on fixed inputs and the exercise's checker catching wrong
answers. The page checks its own launches on every build (collectives and peaks per
flag, the cases static_graph enables and the ones it breaks, N ranks at batch B against
one process at N x B)."""

import math

import pytest

from distlab.chapters.ddp_tuning import flag_table
from distlab.exercises.ddp_tuning import check_scaled_lr
from distlab.tools.lr_scaling import BASE_LR, learning_rate

PG_TIMEOUT = 2.0


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_learning_rate_rules():
    assert learning_rate("unscaled", 4, 0, 16) == BASE_LR
    assert learning_rate("linear", 4, 0, 16) == 4 * BASE_LR
    assert [learning_rate("sqrt + warm-up", 4, s, 16) / BASE_LR for s in range(5)] == [
        0.5,
        1.0,
        1.5,
        2.0,
        2.0,
    ]
    # the same peak as "linear", reached over a quarter of the steps
    assert [
        learning_rate("linear + warm-up", 4, s, 16) / BASE_LR for s in range(5)
    ] == [
        1.0,
        2.0,
        3.0,
        4.0,
        4.0,
    ]


def test_the_flag_table_reads_the_installed_defaults():
    defaults = {name: default for name, default, _ in flag_table()}
    assert defaults["find_unused_parameters"] is False
    assert defaults["static_graph"] is False
    assert defaults["init_sync"] is True
    assert defaults["bucket_cap_mb"] is None
    # the page prints "name default note" in one line that fits its code column
    assert all(len(f"{n:29} {d!s:5} {note}") <= 80 for n, d, note in flag_table())


def scaled_lr(base_lr, base_batch, global_batch, rule, step, warmup_steps):
    if global_batch <= 0 or global_batch % base_batch:
        raise ValueError(
            f"global batch {global_batch} is not a multiple of {base_batch}"
        )
    k = global_batch // base_batch
    peak = base_lr * {"linear": k, "sqrt": math.sqrt(k)}[rule]
    return peak * min(1.0, (step + 1) / warmup_steps) if warmup_steps else peak


def test_the_checker_names_a_late_warm_up_and_a_missing_refusal():
    """The page runs the checker on its answer, this scaled_lr (it passes on
    every build)."""

    def one_step_behind(base_lr, base_batch, global_batch, rule, step, warmup_steps):
        peak = scaled_lr(base_lr, base_batch, global_batch, rule, step, 0)
        return peak * min(1.0, step / warmup_steps) if warmup_steps else peak

    with pytest.raises(AssertionError, match="one step behind"):
        check_scaled_lr(one_step_behind)
    with pytest.raises(AssertionError, match="should raise ValueError"):
        check_scaled_lr(
            lambda *a: scaled_lr(*a) if a[2] > 0 and a[2] % a[1] == 0 else 1.0
        )
