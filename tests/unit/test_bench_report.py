"""The Benchmarks chapter's verdict rule and byte counts, on fixed inputs: a verdict
only where the repeats' ranges allow one (review #7), and the bytes each rank sends."""

import pytest

from distlab.bench.bench_bytes import sent_bytes_per_step
from distlab.bench.report import ratio_range, targets, verdict


def test_a_verdict_needs_the_whole_range_of_the_repeats():
    """Review #7: DDP vs lab 1 read 0.91 against a 0.9 goal while its repeats allow
    0.86 to 1.02. Fixed inputs: that is within noise; a range wholly above or below
    is met or missed; counted bytes (exact) need no repeats; one timing never does."""
    lab2 = [2315.2, 2108.05, 2018.14]
    lab1 = [2353.33, 2311.24, 2267.17]
    low, high = ratio_range(lab2, lab1)
    assert (round(low, 2), round(high, 2)) == (0.86, 1.02)
    assert verdict(low, high, 0.9, ">=", exact=False) == "within noise"
    assert verdict(0.92, 1.1, 0.9, ">=", exact=False) == "met"
    assert verdict(0.7, 0.85, 0.9, ">=", exact=False) == "missed"
    assert verdict(1.1, 1.2, 1.35, "<=", exact=False) == "met"
    assert verdict(0.5, 0.5, 0.52, "<=", exact=True) == "met"
    assert verdict(0.95, 0.95, 0.9, ">=", exact=False) == "within noise"
    runs = [
        {"lab": "lab1_single", "world_size": 1, "tokens_per_s": 2311.24, "mfu": None},
        {"lab": "lab2_ddp", "world_size": 2, "tokens_per_s": 2108.05},
    ]
    runs[0]["tokens_per_s_repeats"], runs[1]["tokens_per_s_repeats"] = lab1, lab2
    row = {r["goal"]: r for r in targets({"runs": runs})}["DDP vs lab 1"]
    assert row["verdict"] == "within noise" and row["met"] is None
    assert row["measured"] == pytest.approx(2108.05 / 2311.24)


def test_bytes_sent_per_step_from_the_parameter_count():
    """Ring algorithm: DDP one all-reduce, FSDP2 2k all-gathers and a reduce-scatter."""
    ddp = {"world_size": 4, "parameters": 1000, "dtype": "fp32", "accum_steps": 2}
    ddp["strategy"] = "ddp+accumulation"
    fsdp = {**ddp, "strategy": "fsdp2+accumulation"}
    assert sent_bytes_per_step(ddp) == pytest.approx(2 * 3 / 4 * 4000)
    assert sent_bytes_per_step(fsdp) == pytest.approx(5 * 3 / 4 * 4000)
    assert sent_bytes_per_step({**fsdp, "world_size": 1}) == 0


def test_a_command_as_shell_lines_keeps_each_option_with_its_value():
    import shlex

    from distlab.bench.report import GPU_COMMAND, as_shell

    shown = as_shell(GPU_COMMAND)
    assert all(len(line) <= 82 for line in shown.splitlines())
    assert shlex.split(shown.replace("\\\n", " ")) == GPU_COMMAND.split()
    assert all(line.strip().startswith("--") for line in shown.splitlines()[1:])
