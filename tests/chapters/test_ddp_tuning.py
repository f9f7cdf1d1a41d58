"""DDP's flags and the learning rate as ranks are added: collectives and peaks per flag, the cases
static_graph enables and the ones it breaks (one-line errors, under a timeout), N ranks at batch B
equal to one process at N x B, the learning-rate rules and the exercise's checker."""

import math

import pytest

from distlab.chapters.ddp_tuning import CASES, case_reference, flag_costs, run_cases
from distlab.exercises.ddp_tuning import check_scaled_lr
from distlab.infra.launch import run_ranks
from distlab.infra.observe import observe
from distlab.tools.lr_scaling import BASE_LR, PER_RANK_BATCH, learning_rate, train_with_rule

PG_TIMEOUT = 2.0


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_collectives_and_peak_per_flag():
    costs = run_ranks(flag_costs, nprocs=2, args=(4,), quiet=True, timeout=120)[0]
    default, unused, static, view = (costs[k] for k in costs)
    # one bucket (the tiny model): one all-reduce a step, and the rebuilt layout broadcast once
    assert default["collectives"] == [{"allreduce": 1}, {"broadcast": 2, "allreduce": 1}, {"allreduce": 1}]
    assert unused["collectives"] == [{"allreduce": 2}] * 3  # + the used-parameter map; never rebuilt
    assert static["collectives"] == [{"allreduce": 2}, {"allreduce": 1}, {"broadcast": 2, "allreduce": 1}]
    assert view["collectives"] == default["collectives"]
    # views keep one copy of the gradients fewer; the others leave the peak alone (the map: 28 int32)
    saved = default["peak_bytes"] - view["peak_bytes"]
    assert 0.9 * default["grad_bytes"] < saved < 1.1 * default["grad_bytes"]
    assert 0 <= unused["peak_bytes"] - default["peak_bytes"] < 1024 and static["peak_bytes"] == default["peak_bytes"]
    assert default["loss"] == unused["loss"] == static["loss"] == view["loss"]


@pytest.fixture(scope="module")
def cases():
    """Every case of CASES, run once on 2 ranks in one launch: name -> (rank 0's result, the
    relative error of each step's gradient against one process)."""
    outcome = observe(run_cases, pg_timeout=PG_TIMEOUT, timeout=90)
    assert outcome.failure is None  # the demos catch their own errors: the launch itself ends cleanly
    out = {"pending": outcome.results[0]["pending"]}
    for name, (_, twice, use_b) in CASES.items():
        got = outcome.results[0][name]
        out[name] = got, [rel(g, h) for g, h in zip(got["grads"], case_reference(2, twice, use_b))]
        got["apart"] = max((rel(g, h) for g, h in zip(got["grads"], outcome.results[1][name]["grads"])), default=0.0)
    return out


def test_reentrant_double_use_is_silently_wrong_by_default_and_right_with_static_graph(cases):
    for name in ("a twice, defaults", "a twice, find_unused_parameters"):
        got, errors = cases[name]
        assert got["error"] is None and len(errors) == 3 and min(errors) > 0.05, name
        assert got["apart"] > 0.05, name  # the un-averaged part differs between the ranks: replicas drift
    got, errors = cases["a twice, static_graph"]
    assert got["error"] is None and len(errors) == 3 and max(errors) < 1e-5 and got["apart"] < 1e-6
    # with a bucket still pending when the checkpoint's backward ends, the second firing is an error
    assert "Expected to mark a variable ready only once" in cases["pending"]


def test_static_graph_trains_a_parameter_that_is_never_used(cases):
    got, errors = cases["b unused, static_graph"]
    assert got["error"] is None and len(errors) == 3 and max(errors) < 1e-6


@pytest.mark.parametrize(
    "name,message,steps",
    [
        ("b used, then not, static_graph", "Expected to have finished reduction", 2),
        ("b unused, then used, static_graph", "graph has changed", 1),
    ],
)
def test_a_graph_that_changes_under_static_graph_fails_in_one_line(cases, name, message, steps):
    got, errors = cases[name]
    assert message in got["error"] and len(errors) == steps
    assert got["waited_s"] < PG_TIMEOUT  # raised by the Reducer at once, not a collective timing out
    if steps == 2:
        assert errors[0] < 1e-6 and errors[1] > 0.05  # step 2's bucket was never reduced


def test_find_unused_parameters_handles_the_changing_graph(cases):
    got, errors = cases["b used, not, used, find_unused_parameters"]
    assert got["error"] is None and len(errors) == 3 and max(errors) < 1e-6


def test_n_ranks_at_batch_b_equal_one_process_at_n_times_b():
    ranks = run_ranks(train_with_rule, nprocs=2, args=("unscaled", 4, 2 * PER_RANK_BATCH), quiet=True, timeout=60)
    one = train_with_rule("unscaled", 4, 2 * PER_RANK_BATCH)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert max(abs(a - b) / b for a, b in zip(ranks[0]["losses"], one["losses"], strict=True)) < 1e-5
    assert abs(ranks[0]["val_loss"] / one["val_loss"] - 1) < 1e-5


def test_learning_rate_rules():
    assert learning_rate("unscaled", 4, 0, 16) == BASE_LR
    assert learning_rate("linear", 4, 0, 16) == 4 * BASE_LR
    assert [learning_rate("sqrt + warm-up", 4, s, 16) / BASE_LR for s in range(5)] == [0.5, 1.0, 1.5, 2.0, 2.0]


def scaled_lr(base_lr, base_batch, global_batch, rule, step, warmup_steps):
    if global_batch <= 0 or global_batch % base_batch:
        raise ValueError(f"global batch {global_batch} is not a multiple of {base_batch}")
    k = global_batch // base_batch
    peak = base_lr * {"linear": k, "sqrt": math.sqrt(k)}[rule]
    return peak * min(1.0, (step + 1) / warmup_steps) if warmup_steps else peak


def test_the_checker_passes_the_answer_and_names_a_late_warm_up(capsys):
    check_scaled_lr(scaled_lr)
    assert capsys.readouterr().out.startswith("passed:")

    def one_step_behind(base_lr, base_batch, global_batch, rule, step, warmup_steps):
        peak = scaled_lr(base_lr, base_batch, global_batch, rule, step, 0)
        return peak * min(1.0, step / warmup_steps) if warmup_steps else peak

    with pytest.raises(AssertionError, match="one step behind"):
        check_scaled_lr(one_step_behind)
    with pytest.raises(AssertionError, match="should raise ValueError"):
        check_scaled_lr(lambda *a: scaled_lr(*a) if a[2] > 0 and a[2] % a[1] == 0 else 1.0)
