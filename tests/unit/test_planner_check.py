"""The planner checked on this machine (``distlab.planner.cpu_check``): its
predictions for the recorded CPU runs of labs 1-5
(results/bench/cpu_shakespeare_fp32.json), fed only the inputs ``python -m
distlab.bench.planner_inputs`` measured (results/planner_cpu_inputs.json). Reads the two
recordings; launches nothing."""

import copy
import json
import math

import pytest
import torch

from distlab.costs.collectives import collective_s
from distlab.model import GPT, preset
from distlab.planner.cpu_check import (
    CHECKED_LABS,
    INPUTS,
    RECORDED,
    check_recorded,
    collectives_check,
    cpu_cluster,
    figure_data,
    plan_of,
    shape_of,
)
from distlab.planner.predict import predict

INPUT_DATA = json.loads(INPUTS.read_text())
RECORDED_DATA = json.loads(RECORDED.read_text())
# the matmul peak; attention at its own
ROWS = check_recorded(INPUT_DATA, RECORDED_DATA, attention="measured")
# the same with the two compute rates measured closer to what the runs do: the matmul
# called back to back by every rank at once, and SDPA's causal attention timed on its
# own (planner_inputs measures both)
MEASURED_RATES = check_recorded(
    INPUT_DATA, RECORDED_DATA, rate="sustained", attention="measured"
)

# Tokens/s, predicted / measured - 1. The planner is optimistic, for reasons a profile
# of lab 1's step (batch 16, 2 threads) and the bench show: its matmuls do run at the
# peak (1.44 s, 182 GFLOP/s), and attention is charged at the rate SDPA's CPU kernel was
# timed at (under a third of the peak), but (1) GELU (erf), LayerNorm, the bias
# gradients' sums and the copies take about 150 ms, not the 13-37 ms of their bytes at a
# copy's bandwidth; (2) gloo's all-gather and reduce-scatter take 1.6-3x the ring's time
# fed the all-reduce's fit (``collectives_check``), so FSDP2 costs 0.28 s (2 ranks) and
# 0.35 s (4) more than DDP per step in an interleaved A/B, where the planner says 0.03;
# (3) on 4 ranks sharing 2 cores the "peak" (the mean of each rank's best call) catches
# moments when a rank has a core to itself: 50 to 82 GFLOP/s per rank from one launch to
# the next, while a rank sustains 40-46. Seen at the peak: -1% to +24% on 1 and 2 ranks,
# +19% to +36% on 4. With the sustained rate: 0% to +22%, the rest being (1) and (2).
# The recorded runs' own repeats spread by 10-30% (lab 3 on 4 ranks: 1373 to 2160
# tokens/s), so each band leaves about 5-15 points beyond what was seen, for a
# re-measured input. (lowest, highest) error by ranks
AT_PEAK_TOLERANCE = {1: (-0.10, 0.30), 2: (-0.10, 0.30), 4: (-0.10, 0.50)}
AT_MEASURED_RATES_TOLERANCE = (-0.10, 0.25)
# mean |error| over the 13 runs: 9.5% and 10.1% seen (two inputs files)
AT_MEASURED_RATES_MEAN = 0.13
# Peak bytes (MemTracker at rank 0's second step): deterministic, no noise. The peaks
# come at the loss, before backward has made any gradient (the labs zero them with
# set_to_none), and the planner counts what exists then: DDP's buckets and any
# accumulated .grad beside them, FSDP2's unsharded gradients while it accumulates. Lab 1
# (+5.5%) has no DDP and so no buckets, which the planner's "ddp" on one rank counts;
# lab 5 on 4 ranks (-6.7%) peaks in backward, at a moment other than the planner's two
# (the loss, the last block). DDP's runs are within 0.2%.
PEAK_TOLERANCE = 0.07
# labs 2 and 3: DDP's buckets, and lab 3's accumulated .grad beside them
DDP_PEAK_TOLERANCE = 0.002


def test_every_lab_1_to_5_at_every_recorded_rank_count_is_checked_and_lab_6_is_not():
    recorded = {
        (r["lab"], r["world_size"])
        for r in RECORDED_DATA["runs"]
        if r["lab"] in CHECKED_LABS
    }
    assert {(r["lab"], r["ranks"]) for r in ROWS} == recorded
    assert {r["ranks"] for r in ROWS} == {1, 2, 4} and len(ROWS) == 13
    assert all(r["lab"] != "lab6_accelerate" for r in ROWS)


def _exact_state_bytes(run: dict) -> int:
    """Model state per rank as torch holds it: FSDP2 pads each parameter's dim 0 to a
    multiple of the ranks (torch.chunk: every shard as long as the first), and AdamW
    keeps a 4-byte fp32 ``step`` per parameter tensor, on every rank, unsharded."""
    with torch.device("meta"):
        model = GPT(
            preset(run["config"]["preset"], vocab_size=shape_of(run).vocab_size)
        )
    sharded = run["strategy"].startswith("fsdp2")
    n = run["world_size"] if sharded else 1
    local = sum(math.ceil(p.shape[0] / n) * p[0].numel() for p in model.parameters())
    # params, grads, moments, steps
    return 4 * local * 2 + 2 * 4 * local + 4 * len(list(model.parameters()))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['lab']}-{r['ranks']}")
def test_model_state_is_the_zero_formula_and_the_rest_is_padding_and_adamw_steps(row):
    run = next(
        r
        for r in RECORDED_DATA["runs"]
        if (r["lab"], r["world_size"]) == (row["lab"], row["ranks"])
    )
    measured = row["state_bytes"]["measured"]
    assert _exact_state_bytes(run) == measured  # every byte accounted for
    # the planner's 16 bytes per parameter (sharded by N) leaves out only those few
    # bytes: 304 of AdamW's steps, and at most 3 padded rows of the 384-wide embedding
    # in 4 fp32 copies
    extra = measured - row["state_bytes"]["predicted"]
    assert (
        0 < extra <= 4 * 76 + 3 * 384 * 4 * 4
        and abs(row["state_bytes"]["error_pct"]) < 0.02
    )


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['lab']}-{r['ranks']}")
def test_peak_bytes_within_the_stated_tolerance(row):
    error = row["peak_bytes"]["error_pct"] / 100
    limit = (
        DDP_PEAK_TOLERANCE
        if row["lab"] in ("lab2_ddp", "lab3_grad_accum")
        else PEAK_TOLERANCE
    )
    assert abs(error) <= limit, (
        f"{row['lab']} on {row['ranks']}: {error:+.1%} (at most {limit:.1%})"
    )


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['lab']}-{r['ranks']}")
def test_tokens_per_s_at_the_matmul_peak_within_the_stated_tolerance(row):
    error = row["tokens_per_s"]["error_pct"] / 100
    low, high = AT_PEAK_TOLERANCE[row["ranks"]]
    assert low <= error <= high, (
        f"{row['lab']} on {row['ranks']}: {error:+.1%} (allowed {low:+.0%} to "
        f"{high:+.0%})"
    )


@pytest.mark.parametrize(
    "row", MEASURED_RATES, ids=lambda r: f"{r['lab']}-{r['ranks']}"
)
def test_tokens_per_s_at_the_measured_rates_within_the_stated_tolerance(row):
    error = row["tokens_per_s"]["error_pct"] / 100
    low, high = AT_MEASURED_RATES_TOLERANCE
    assert low <= error <= high, (
        f"{row['lab']} on {row['ranks']}: {error:+.1%} (allowed {low:+.0%} to "
        f"{high:+.0%})"
    )


def test_at_the_measured_rates_the_mean_error_is_small_enough_that_dropping_a_term_shows():  # noqa: E501
    """Leaving attention out (about 0.24-0.29 s of a 1.7-2.4 s step) would add 15-20
    points to every row."""
    mean = (
        sum(abs(r["tokens_per_s"]["error_pct"]) for r in MEASURED_RATES)
        / 100
        / len(MEASURED_RATES)
    )
    assert mean <= AT_MEASURED_RATES_MEAN, f"mean |error| {mean:.1%}"


def test_gloo_gathers_and_scatters_slower_than_the_ring_fed_the_all_reduce_fit():
    """Why FSDP2's runs miss most: its collectives are not half an all-reduce each
    on gloo."""
    rows = collectives_check(INPUT_DATA)
    assert {(r["collective"], r["ranks"]) for r in rows} == {
        (k, n) for k in ("all_gather", "reduce_scatter") for n in (2, 4)
    }
    # the recorded inputs (results/planner_cpu_inputs.json, read above), not a timing
    # taken now
    assert all(r["measured_s"] > 1.2 * r["predicted_s"] for r in rows), (
        rows
    )  # timing-ok: a recorded file


def test_attention_at_its_measured_rate_is_slower_than_at_the_matmul_peak():
    """The one term that explains most of the miss at 1 and 2 ranks: SDPA's kernel is
    not a GEMM."""
    for n in (1, 2, 4):
        efficiency = cpu_cluster(
            INPUT_DATA, n, attention="measured"
        ).device.attention_efficiency
        assert 0.1 < efficiency < 0.6, (
            f"{n} ranks: attention at {efficiency:.2f} of the matmul peak"
        )


def test_on_these_cores_every_collective_is_exposed_and_each_one_counts():
    """overlap=False: the step pays all of the communication, collective by collective.
    Checked against the ring's cost computed here from the fit, so dropping a collective
    (or a block's) fails."""
    for run in RECORDED_DATA["runs"]:
        if run["lab"] not in CHECKED_LABS or run["world_size"] == 1:
            continue
        shape, plan, cluster = (
            shape_of(run),
            plan_of(run),
            cpu_cluster(INPUT_DATA, run["world_size"]),
        )
        t = predict(shape, cluster, plan)["time"]
        assert t["exposed"] == pytest.approx(t["communication"], rel=1e-9)
        n, link, L = cluster.gpus, cluster.intra, shape.n_layer
        # one all-reduce of every gradient per step, in DDP's buckets (1 MiB first)
        if plan.strategy == "ddp":
            grads = 4 * shape.n_params()
            buckets = 1 + math.ceil((grads - 2**20) / (25 * 2**20))
            expected = {
                "all-reduce": collective_s("all-reduce", grads, n, link)
                + (buckets - 1) * 2 * (n - 1) * link.alpha
            }
        # FSDP2: per micro-batch the root and every block gathered twice; once per step
        # reduce-scattered
        else:
            expected = {
                "all-gather": plan.accum
                * (
                    collective_s("all-gather", 4 * shape.root_params(), n, link)
                    + 2
                    * L
                    * collective_s("all-gather", 4 * shape.block_params(), n, link)
                ),
                "reduce-scatter": L
                * collective_s("reduce-scatter", 4 * shape.block_params(), n, link)
                + collective_s("reduce-scatter", 4 * shape.root_params(), n, link),
            }
        assert t["collectives"] == pytest.approx(expected, rel=1e-9)


def test_the_vocabulary_comes_from_the_run_not_a_constant():
    run = RECORDED_DATA["runs"][0]
    assert shape_of(run).n_params() == run["parameters"]
    odd = copy.deepcopy(run)
    # ten more characters in the data: ten more embedding rows
    odd["parameters"] += 384 * 10
    assert shape_of(odd).vocab_size == shape_of(run).vocab_size + 10
    odd["parameters"] += 1
    with pytest.raises(ValueError, match="no vocabulary"):
        shape_of(odd)


def test_the_figure_data_pairs_each_run_with_its_prediction():
    points = figure_data(ROWS)
    assert [label for label, *_ in points["tokens_per_s"]][:2] == ["lab1 x1", "lab2 x1"]
    assert all(len(v) == len(ROWS) for v in points.values())


def test_bad_input_gives_one_clear_error():
    run = copy.deepcopy(RECORDED_DATA["runs"][0])
    run["lab"] = "lab7_pipeline"
    with pytest.raises(
        ValueError,
        match="no plan for lab 'lab7_pipeline'; the planner is checked on lab1_single",
    ):
        plan_of(run)
    with pytest.raises(
        ValueError, match="no planner inputs measured at 8 ranks; measured at: 1, 2, 4"
    ):
        cpu_cluster(INPUT_DATA, 8)
    with pytest.raises(ValueError, match="unknown compute rate 'best'"):
        cpu_cluster(INPUT_DATA, 2, rate="best")
    with pytest.raises(ValueError, match="unknown attention rate 'flash'"):
        cpu_cluster(INPUT_DATA, 2, attention="flash")
    two = copy.deepcopy(RECORDED_DATA["runs"][0])
    two["world_size"] = 2
    with pytest.raises(ValueError, match="lab1_single runs on one process"):
        plan_of(two)
