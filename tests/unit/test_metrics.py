"""LogWindow: which steps a lab logs with --log-every, and the tokens/s it reports."""

import math

import pytest
import torch

from distlab.errors import UserError
from distlab.metrics import LogWindow, largest_differences

CPU = torch.device("cpu")


def logged(
    start_step: int, steps: int, log_every: int, eval_every: int = 100
) -> list[int]:
    window = LogWindow(CPU, 1, start_step, steps, log_every)
    return [
        s
        for s in range(start_step, steps)
        if window.is_log_point(s, (s + 1) % eval_every == 0)
    ]


def test_log_every_1_logs_every_step():
    assert logged(0, 7, 1) == list(range(7))


def test_log_every_k_logs_the_warm_up_steps_every_kth_step_evaluations_and_the_last():
    assert logged(0, 20, 3) == [0, 1, 2, 5, 8, 11, 14, 17, 19]
    assert logged(0, 20, 5, eval_every=7) == [0, 1, 4, 6, 9, 13, 14, 19]
    # resumed at step 7: its first two steps warm up again
    assert logged(7, 20, 5) == [7, 8, 9, 14, 19]


def test_each_record_is_the_logged_steps_loss_and_the_windows_throughput(monkeypatch):
    # open, close of steps 0, 1, then of steps 2-5
    clock = iter([0.0, 1.0, 1.0, 3.0, 10.0, 18.0])
    monkeypatch.setattr("distlab.metrics.time.perf_counter", lambda: next(clock))
    window = LogWindow(CPU, tokens_per_step=100, start_step=0, steps=6, log_every=10)
    records = []
    for step in range(6):
        window.open(step)
        if window.is_log_point(step):
            records.append(window.close(step, loss=float(step), lr=0.1))
    assert [r["step"] for r in records] == [0, 1, 5]
    assert list(records[-1]) == ["step", "loss", "lr", "tokens_per_s", "step_s"]
    assert (
        records[-1]["loss"],
        records[-1]["tokens_per_s"],
        records[-1]["step_s"],
    ) == (5.0, 400 / 8, 2.0)
    assert (records[1]["tokens_per_s"], records[1]["step_s"]) == (50.0, 2.0)
    assert window.tokens_per_s == 400 / 8  # the two warm-up steps are left out


def test_a_run_of_two_steps_or_fewer_times_all_of_them(monkeypatch):
    clock = iter([0.0, 2.0, 2.0, 4.0])
    monkeypatch.setattr("distlab.metrics.time.perf_counter", lambda: next(clock))
    window = LogWindow(CPU, tokens_per_step=10, start_step=0, steps=2, log_every=1)
    for step in range(2):
        window.open(step)
        window.close(step, loss=1.0)
    assert window.tokens_per_s == 5.0
    assert math.isnan(LogWindow(CPU, 10, 0, 0, 1).tokens_per_s)  # no step ran


def test_a_loss_that_is_not_finite_stops_the_run_at_the_log_point():
    window = LogWindow(CPU, 1, 0, 10, 1)
    window.open(3)
    with pytest.raises(UserError, match="loss is nan at step 3: training diverged"):
        window.close(3, loss=float("nan"))


def test_log_every_below_1_is_refused():
    with pytest.raises(UserError, match="--log-every must be 1 or more"):
        LogWindow(CPU, 1, 0, 10, 0)


def test_a_checkpoint_step_is_a_log_point_so_the_save_is_in_no_window():
    window = LogWindow(CPU, 1, 0, 20, log_every=6, checkpoint_every=4)
    points = [s for s in range(20) if window.is_log_point(s)]
    # warm-up, every 6th, every 4th (a save follows it), the last
    assert points == [0, 1, 3, 5, 7, 11, 15, 17, 19]


def timed_run(monkeypatch, checkpoint_every: int, save_s: float = 50.0) -> float:
    """tokens/s of 12 one-second steps, --log-every 6, a ``save_s``-second save after
    every 4th step, as a lab runs them: open, step, close at a log point, save."""
    now = [0.0]
    monkeypatch.setattr("distlab.metrics.time.perf_counter", lambda: now[0])
    window = LogWindow(CPU, 100, 0, 12, 6, checkpoint_every)
    for step in range(12):
        window.open(step)
        now[0] += 1.0  # the step
        if window.is_log_point(step):
            window.close(step, loss=1.0)
        if (step + 1) % 4 == 0:
            now[0] += save_s  # the checkpoint
    return window.tokens_per_s


def test_the_saves_seconds_stay_out_of_tokens_per_s(monkeypatch):
    assert timed_run(monkeypatch, checkpoint_every=4) == 100.0  # one step a second
    # a window that does not know the saves times them (review gpu.md #1: halved)
    assert timed_run(monkeypatch, checkpoint_every=0) < 50.0
    assert timed_run(monkeypatch, checkpoint_every=4, save_s=0.0) == 100.0


def test_largest_differences_are_relative_to_the_reference_and_need_the_same_steps():
    reference = [
        {"step": 0, "loss": 2.0, "grad_norm": 1.0},
        {"step": 1, "loss": 4.0, "grad_norm": -2.0},
    ]
    run = [
        {"step": 0, "loss": 2.0, "grad_norm": 2.0},
        {"step": 1, "loss": 5.0, "grad_norm": -2.0},
    ]
    assert largest_differences(run, reference) == {"loss": 0.25, "grad_norm": 1.0}
    with pytest.raises(ValueError, match="different steps"):
        largest_differences(run[:1], reference)
