"""The planner's calibration (``distlab.planner.calibrate``): one achieved GEMM
efficiency per GPU kind, fitted on published runs and checked on each run with that run
left out, and the command line that prints the ranges."""

import re

import pytest

from distlab.planner import calibrate
from distlab.planner.calibrate import (
    implied_efficiency,
    inputs,
    leave_one_out,
    predict_range,
)
from distlab.planner.cli import main
from distlab.planner.predict import predict
from distlab.planner.runs import RUNS, RUNS_BY_NAME

H100_8B = "torchtitan-h100-8b-fsdp-8gpu"
GiB = 2**30


def test_the_implied_efficiency_gives_back_the_published_speed():
    for name in (H100_8B, "llmc-gpt2-124m-8xa100", "torchtitan-llama3-70b-full"):
        run = RUNS_BY_NAME[name]
        e = implied_efficiency(run)
        got = predict(*inputs(run), e)["tokens_per_s_per_gpu"]
        assert got == pytest.approx(run["published"]["tokens_per_s_per_gpu"], rel=1e-6)
        assert 0.05 < e < 0.95


def test_a_run_left_out_is_not_in_its_own_calibration(monkeypatch):
    shape, cluster, plan = inputs(RUNS_BY_NAME[H100_8B])
    out = predict_range(shape, cluster, plan, exclude=H100_8B)
    assert H100_8B not in out["calibrated_on"] and len(out["calibrated_on"]) >= 2
    inside = predict_range(shape, cluster, plan)
    assert H100_8B in inside["calibrated_on"]
    # the run's own efficiency would widen the range: leaving it out is seen
    assert out["efficiency"] != inside["efficiency"]
    with pytest.raises(ValueError, match="unknown run 'no-such-run'"):
        predict_range(shape, cluster, plan, exclude="no-such-run")


def test_a_gpu_kind_with_too_few_runs_is_refused(monkeypatch):
    only = [r for r in RUNS if r["gpu"] != "h100-96gb-500w"] + [RUNS_BY_NAME[H100_8B]]
    monkeypatch.setattr(calibrate, "RUNS", only)
    with pytest.raises(ValueError, match="1 published run"):
        predict_range(*inputs(RUNS_BY_NAME[H100_8B]))


def test_leaving_out_a_whole_source_predicts_from_the_other_sources_only():
    rows = {r["run"]: r for r in leave_one_out(by="source")}
    # torchtitan's 96 GB H100 runs: no other source ran that GPU kind
    assert "calibrate h100-96gb-500w" in rows[H100_8B]["why_not"]
    tt = rows["torchtitan-llama3-8b-sel-op"]
    assert tt["efficiency"] != implied_efficiency(RUNS_BY_NAME[tt["run"]])
    with pytest.raises(ValueError, match="by 'run' or 'source'"):
        leave_one_out(by="gpu")


def test_the_command_line_prints_a_range_holding_the_8b_h100_run_left_out(capsys):
    args = "--model llama3-8b --gpu h100-96gb-500w --gpus 8 --strategy fsdp2 "
    args += f"--ac selective-op --micro-batch 2 --seq-len 8192 --leave-out {H100_8B}"
    assert main(args.split()) == 0
    out = capsys.readouterr().out
    lo, hi = (
        float(x.replace(",", ""))
        for x in re.search(r"tokens/s per GPU ([\d,]+) to ([\d,]+)", out).groups()
    )
    assert lo <= 5762 <= hi
    mlo, mhi = map(
        float, re.search(r"memory per GPU ([\d.]+) to ([\d.]+) GiB", out).groups()
    )
    assert mlo <= 82.4 <= mhi
    assert main(["--validate"]) == 0
    table = capsys.readouterr().out
    assert all(r["name"][:44] in table for r in RUNS)


def test_bad_command_lines_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--gpu", "a100-80gb"])
    assert "the following arguments are required: --model, --gpus" in (
        capsys.readouterr().err
    )
    assert main("--model llama3-8b --gpu a100-80gb --gpus 8 --leave-out x".split()) == 2
    assert "unknown run 'x'" in capsys.readouterr().err
