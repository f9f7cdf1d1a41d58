"""The planner: its counts against the book's exact formulas and the real model, its
memory terms against the ZeRO paper's Table 1, NCCL's bus bandwidth across nodes, the
step's timeline, the leave-one-out check against the issue's targets, the recommender,
the exercise's checker, the CLI's bad-input errors. The CPU check is
tests/unit/test_planner_check.py; the Llama block's measurement,
tests/unit/test_llama_block.py."""

from __future__ import annotations

import dataclasses

import pytest

from distlab.chapters.planner import (
    KEY_RUN,
    MEMORY_TARGET,
    MISS,
    TARGET,
    before_and_after,
    busbw_rows,
    cpu_rows,
    implied_rows,
    memory_rows,
    recommendation,
    step_timeline,
    validation,
)
from distlab.exercises.planner import check_70b_plan
from distlab.flops import flops_per_token
from distlab.model import PRESETS, parameter_formula
from distlab.planner.calibrate import inputs
from distlab.planner.hardware import GPUS
from distlab.planner.predict import Plan, gpu_cluster, memory, predict
from distlab.planner.recommend import explain, recommend
from distlab.planner.runs import RUNS, RUNS_BY_NAME
from distlab.planner.shapes import SHAPES, from_gpt_config
from distlab.tools import plan as plan_cli
from distlab.tools.memory_checks import PAPER_DP, PAPER_TABLE_1, agrees_with_print


@pytest.mark.parametrize("name", PRESETS)
def test_shapes_of_the_books_model_count_what_its_formulas_count(name):
    cfg = PRESETS[name]
    s = from_gpt_config(name, name, cfg, "test")
    assert s.n_params() == parameter_formula(cfg)
    assert s.flops_per_token(cfg.block_size) == flops_per_token(cfg)


def test_llama3_and_gpt2_parameter_counts_are_the_published_ones():
    # Meta's Llama 3 counts (as the released checkpoints hold them) and GPT-2's
    # (Hugging Face's)
    expected = {
        "llama3-8b": 8_030_261_248,
        "llama3-70b": 70_553_706_496,
        "gpt2-small": 124_439_808,
        "gpt2-medium": 354_823_168,
        "gpt2-large": 774_030_080,
        "gpt2-xl": 1_557_611_200,
    }
    assert {k: SHAPES[k].n_params() for k in expected} == expected


def test_memory_terms_reproduce_the_zero_papers_table_1():
    """Model state per parameter times the paper's parameter counts gives every
    printed cell."""
    shape = SHAPES["llama3-8b"]
    for psi, stages in PAPER_TABLE_1.items():
        for stage, printed in stages.items():
            strategy = {1: "zero1", 2: "zero2", 3: "fsdp2"}[stage]
            for n, cell in zip(PAPER_DP, printed.split()):
                m = memory(
                    shape,
                    gpu_cluster("a100-80gb", n, max(n, 8), "ib-200g"),
                    Plan(strategy, state="bf16_mixed"),
                )
                per_param = m["state"] / shape.n_params()
                assert agrees_with_print(per_param * psi / 1e9, cell), (
                    psi,
                    stage,
                    n,
                    cell,
                )


def test_one_gpu_communicates_nothing_and_a_cpu_hides_nothing():
    shape = SHAPES["gpt2-small"]
    alone = predict(shape, gpu_cluster("a100-80gb", 1), Plan("fsdp2", 4, 1024))
    assert alone["time"]["communication"] == 0 and alone["time"]["exposed"] == 0
    cluster = gpu_cluster("a100-80gb", 16, 8, "ib-200g")
    for strategy in ("ddp", "zero2", "fsdp2"):
        plan = Plan(strategy, 4, 1024)
        hidden = predict(shape, cluster, plan)["time"]
        exposed = predict(shape, dataclasses.replace(cluster, overlap=False), plan)[
            "time"
        ]
        # nothing overlaps
        assert exposed["exposed"] == pytest.approx(exposed["communication"])
        assert hidden["exposed"] < exposed["exposed"] and hidden[
            "communication"
        ] == pytest.approx(exposed["communication"])


def test_sharding_and_checkpointing_trade_memory_for_time():
    shape, cluster = SHAPES["llama3-8b"], gpu_cluster("h100-sxm", 64, 8, "ib-400g")
    base = predict(shape, cluster, Plan("ddp", 1, 4096))
    sharded = predict(shape, cluster, Plan("fsdp2", 1, 4096))
    full = predict(shape, cluster, Plan("fsdp2", 1, 4096, ac="full"))
    assert sharded["memory"]["optimizer"] == base["memory"]["optimizer"] / 64
    assert full["memory"]["activations"] < sharded["memory"]["activations"]
    assert full["time"]["recompute"] > 0 == sharded["time"]["recompute"]
    assert full["time"]["compute"] > sharded["time"]["compute"]


def test_a_ring_across_nodes_gets_a_channel_per_nic_capped_by_nvlink():
    # 8 HDR NICs of 25 GB/s: 200 GB/s, not one NIC's 25 (review #1)
    assert gpu_cluster("a100-80gb", 64, 8, "ib-200g").inter.busbw == 200e9
    # 8 NDR NICs would give 400 GB/s, above the A100's NVLink (300 GB/s each way)
    assert gpu_cluster("a100-80gb", 64, 8, "ib-400g").inter.busbw == 300e9
    # a reader's nccl-tests busbw replaces the estimate
    assert gpu_cluster("a100-80gb", 64, 8, "ib-200g", busbw=91e9).inter.busbw == 91e9
    rows = busbw_rows()
    assert [r["busbw"] for r in rows[:4]] == [25e9, 50e9, 100e9, 200e9]
    speeds = [r["tokens_per_s"] for r in rows[:4]]
    assert speeds == sorted(speeds) and speeds[0] < speeds[-1]


def test_the_timeline_waits_are_the_exposed_communication():
    t = step_timeline()
    L = t["n_layer"]
    labels = [label for _, label, _, _ in t["spans"]]
    for kind in ("forward", "backward"):
        assert sum(x.startswith(f"{kind} ") for x in labels) == L, kind
    # the root and every block gathered before forward, every block's gradients
    # reduced, and the root's
    assert {f"gather {i}" for i in range(L)} | {"gather root"} <= set(labels)
    assert {f"reduce {i}" for i in range(L)} | {"reduce root"} <= set(labels)
    waited = sum(e - s for s, e in t["waits"])
    assert waited == pytest.approx(t["exposed"], rel=1e-9) and waited > 0


def test_leave_one_out_meets_the_issues_targets():
    v = validation()
    names = {r["run"] for r in v["rows"]}
    assert names == {r["name"] for r in RUNS}
    assert len(v["timed"]) >= 10 and v["sources"] >= 3
    assert v["median"] <= TARGET
    beyond = [(r["run"], r["error"]) for r in v["timed"] if abs(r["error"]) > MISS]
    assert not beyond and not v["over_miss"], beyond
    assert v["memory"] and v["memory_worst"] <= MEMORY_TARGET
    for r in v["timed"]:
        lo, mid, hi = r["predicted"]
        assert lo <= mid <= hi
        assert r["inside"] == (lo <= r["published"] <= hi)


def test_the_old_a100_agreement_was_a_slow_network_cancelling_fast_gemms():
    # at MAMF's efficiency: one NIC per node "agrees", NCCL's channels do not
    rows = [r for r in before_and_after() if r["run"].startswith("torchtitan")]
    assert len(rows) == 3
    for r in rows:
        assert abs(r["one_nic"]) < 0.10 and r["nccl"] > 0.25, r


def test_every_eager_run_implies_less_than_the_microbenchmark():
    rows = implied_rows()
    assert {r["run"] for r in rows} == {
        r["name"] for r in RUNS if not r["plan"].get("float8")
    }
    for r in rows:
        assert 0 < r["efficiency"] < GPUS[r["gpu"]].matmul_efficiency, r
    key = next(r for r in rows if r["run"] == KEY_RUN)
    # torchtitan's footnote: the part's peak is between SXM (989) and NVL (835)
    assert key["efficiency_nvl"] == pytest.approx(key["efficiency"] * 989 / 835)


def test_llmc_state_matches_its_log_and_the_activations_miss_is_the_loss():
    parts = {r["part"]: r for r in memory_rows()}
    for part in ("parameters", "gradients", "AdamW moments, master"):
        # llm.c's allocations, to the MiB
        assert abs(parts[part]["error"]) < 0.002, part
    # PyTorch's fp32 loss tensors, which llm.c does not keep
    assert parts["activations"]["error"] > 0.10


def test_the_cpu_check_covers_labs_1_to_5_at_1_2_4_ranks():
    rows = cpu_rows()
    assert len(rows) == 13 and {r["ranks"] for r in rows} == {1, 2, 4}
    assert all(abs(r["state_error"]) < 2e-4 for r in rows)


def test_torchtitan_runs_use_their_stated_configuration():
    for name in ("torchtitan-llama3-8b-sel-op", "torchtitan-llama3-70b-full"):
        shape, cluster, plan = inputs(RUNS_BY_NAME[name])
        assert (cluster.gpus, plan.micro_batch, plan.seq_len, plan.accum) == (
            64,
            1,
            8192,
            1,
        )
        assert (
            cluster.device.peak_flops == 312e12
            and plan.strategy == "fsdp2"
            and plan.reduce_bytes == 4
        )
    assert inputs(RUNS_BY_NAME["torchtitan-llama3-70b-full"])[2].ac == "full"


def test_the_recommender_ranks_what_fits_fastest_first():
    shape, cluster = SHAPES["llama3-70b"], gpu_cluster("a100-80gb", 64, 8, "ib-200g")
    ranked = recommend(shape, cluster, 8192, 64)
    assert ranked and all(p["memory"]["fits"] for _, p in ranked)
    # nothing else fits 70B at 8,192 tokens on 80 GB
    assert {plan.ac for plan, _ in ranked} == {"full"}
    speeds = [
        p["tokens_per_s_per_gpu"]
        for _, p in recommend(SHAPES["llama3-8b"], cluster, 8192, 256)
    ]
    assert speeds == sorted(speeds, reverse=True)
    assert "why:" in explain(recommend(SHAPES["llama3-8b"], cluster, 8192, 256))
    assert explain([]).startswith("no plan fits")
    rec = recommendation()
    hsdp = [i + 1 for i, (p, _) in enumerate(rec["ranked"]) if p.strategy == "hsdp"]
    assert rec["hsdp_rank"] == (hsdp[0] if hsdp else None)
    assert rec["first"] == rec["ranked"][0][0]


def test_the_exercise_checker_passes_the_pages_solution_and_fails_a_wrong_plan(capsys):
    check_70b_plan(
        lambda: Plan("fsdp2", micro_batch=2, seq_len=8192, accum=1, ac="full")
    )
    assert capsys.readouterr().out.startswith("passed:")
    with pytest.raises(AssertionError, match="more than 90%"):
        check_70b_plan(
            lambda: Plan("fsdp2", micro_batch=2, seq_len=8192, accum=1, ac="none")
        )
    with pytest.raises(AssertionError, match="global batch"):
        check_70b_plan(
            lambda: Plan("fsdp2", micro_batch=1, seq_len=8192, accum=1, ac="full")
        )


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model", "llama4"],
            "unknown model 'llama4'; choose one of tiny, shakespeare",
        ),
        (["--gpu", "b200"], "unknown GPU 'b200'; choose one of a100-80gb,"),
        (
            ["--strategy", "tp"],
            "unknown strategy 'tp'; choose one of ddp, zero1, zero2, fsdp2",
        ),
        (
            ["--ac", "some"],
            "unknown activation checkpointing 'some'; choose one of none, full",
        ),
        (
            ["--strategy", "hsdp", "--group", "3"],
            "group size that divides the 64 GPUs, got 3",
        ),
        (["--network", "wifi"], "unknown network 'wifi'; choose one of"),
        (["--gpus", "12"], "12 GPUs is not a whole number of nodes of 8"),
        (["--recommend", "--global-batch", "100"], "must be a multiple of the 64 GPUs"),
        (
            ["--seq-len", "2048", "--model", "gpt2-small"],
            "longer than gpt2-small's 1024 positions",
        ),
    ],
)
def test_cli_bad_input_is_one_line_that_lists_the_choices(args, message, capsys):
    base = {
        "--model": "llama3-8b",
        "--gpu": "a100-80gb",
        "--gpus": "64",
        "--network": "ib-200g",
    }
    for flag in args[::2]:
        base.pop(flag, None)
    argv = [x for kv in base.items() for x in kv] + args
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_prints_the_prediction(capsys):
    argv = [
        "--model",
        "llama3-8b",
        "--gpu",
        "a100-80gb",
        "--gpus",
        "64",
        "--network",
        "ib-200g",
        "--seq-len",
        "8192",
    ]
    assert plan_cli.main([*argv, "--ac", "selective-op"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per GPU" in out and "all-gather" in out and "fits" in out
    # a range, from the calibration
    assert "to" in out.splitlines()[-5]
