"""The planner: its counts against the book's exact formulas and the real model, its
memory terms against the ZeRO paper's Table 1, its predictions against published runs
(within 20% or a miss the page explains), its recommender, CLI and bad-input errors. The
CPU check is tests/unit/test_planner_check.py."""

from __future__ import annotations

import dataclasses

import pytest

from distlab.chapters.planner import (
    MEMORY_TARGET,
    TARGET,
    cpu_rows,
    implied_matmul_efficiency,
    memory_rows,
    published_memory_rows,
    published_rows,
    setup,
)
from distlab.exercises.planner import check_70b_plan
from distlab.flops import flops_per_token
from distlab.infra.paths import REPO_ROOT
from distlab.memory import activation_bytes_formula
from distlab.model import PRESETS, parameter_formula
from distlab.tools import plan as plan_cli
from distlab.tools.memory_calculator import activation_bytes
from distlab.tools.memory_checks import PAPER_DP, PAPER_TABLE_1, agrees_with_print
from distlab.tools.planner import Plan, activation_peak, gpu_cluster, memory, predict
from distlab.tools.planner_comm import ring_seconds
from distlab.tools.published_runs import RUNS_BY_NAME
from distlab.tools.recommend import explain, recommend
from distlab.tools.shapes import SHAPES, from_gpt_config
from distlab.tools.step_model import ring_all_reduce_s

# runs the planner misses by more than TARGET, each explained on book/planner.md
DOCUMENTED_MISSES = {
    "llmc-gpt2-1558m-8xh100",
    "torchtitan-h100-8b-fsdp-8gpu",
    "torchtitan-h100-8b-fsdp-128gpu",
}


@pytest.mark.parametrize("name", PRESETS)
def test_shapes_of_the_books_model_count_what_its_formulas_count(name):
    cfg = PRESETS[name]
    s = from_gpt_config(name, name, cfg, "test")
    assert s.n_params() == parameter_formula(cfg)
    assert s.flops_per_token(cfg.block_size) == flops_per_token(cfg)
    for w in (4, 2):
        per_block = activation_bytes_formula(cfg, 3, 5, w)["per_block"]
        assert (
            3 * 5 * (w * s.saved_values_per_token() + s.saved_small_bytes_per_token(w))
            == per_block
        )


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


@pytest.mark.parametrize("name", ["tiny", "shakespeare"])
@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("dtype,w", [("fp32", 4), ("bf16_mixed", 2)])
def test_activation_peak_is_the_memory_calculators_to_the_byte(name, ac, dtype, w):
    cfg = PRESETS[name]
    s = from_gpt_config(name, name, cfg, "test")
    expected = activation_bytes(cfg, 3, cfg.block_size, ac == "full", dtype)["peak"]
    assert activation_peak(s, 3, cfg.block_size, ac, 2, w) == expected


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


def test_the_ring_is_the_collectives_chapters():
    link = gpu_cluster("h100-sxm", 8).intra
    for n in (2, 8, 64):
        assert ring_seconds("all_reduce", 1e9, n, link) == pytest.approx(
            ring_all_reduce_s(1e9, n, link)
        )
        assert ring_seconds("all_gather", 1e9, n, link) == pytest.approx(
            ring_all_reduce_s(1e9, n, link) / 2
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
        assert (
            hidden["exposed"] < exposed["exposed"]
            and hidden["communication"] == exposed["communication"]
        )


def test_sharding_and_checkpointing_trade_memory_for_time():
    shape, cluster = SHAPES["llama3-8b"], gpu_cluster("h100-sxm", 64, 8, "ib-400g")
    base = predict(shape, cluster, Plan("ddp", 1, 4096))
    sharded = predict(shape, cluster, Plan("fsdp2", 1, 4096))
    full = predict(shape, cluster, Plan("fsdp2", 1, 4096, ac="full"))
    assert sharded["memory"]["optimizer"] == base["memory"]["optimizer"] / 64
    assert full["memory"]["activations"] < sharded["memory"]["activations"]
    assert full["time"]["recompute"] > 0 == sharded["time"]["recompute"]
    assert full["time"]["compute"] > sharded["time"]["compute"]


def test_published_runs_are_predicted_within_target_or_the_miss_is_documented():
    rows = {r["run"]: r for r in published_rows()}
    # and the eager H100 rows
    assert set(RUNS_BY_NAME) < set(rows) and len(rows) == len(RUNS_BY_NAME) + 2
    for name, r in rows.items():
        assert r["within"] == (name not in DOCUMENTED_MISSES), (name, r["error"])
        # every miss: predicted too fast
        assert name not in DOCUMENTED_MISSES or r["error"] > TARGET
    page = (REPO_ROOT / "book" / "planner.md").read_text()
    assert "The misses are the three\nruns on H100s" in page


def test_memory_within_target_where_a_publication_gives_it():
    rows = published_memory_rows()
    assert len(rows) == 2 and all(abs(r["error"]) <= MEMORY_TARGET for r in rows)


def test_the_h100_miss_is_the_gemm_efficiency_and_the_memory_miss_the_loss():
    run = RUNS_BY_NAME["llmc-gpt2-1558m-8xh100"]
    implied = implied_matmul_efficiency(run)
    # slower GEMMs than MAMF's best shape
    assert 0.4 < implied < setup(run)[1].device.matmul_efficiency
    parts = {r["part"]: r for r in memory_rows()}
    for part in ("parameters", "gradients", "AdamW moments and master weights"):
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
        shape, cluster, plan = setup(RUNS_BY_NAME[name])
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
    assert setup(RUNS_BY_NAME["torchtitan-llama3-70b-full"])[2].ac == "full"


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
        (["--gpu", "b200"], "unknown GPU 'b200'; choose one of a100-80gb, h100-sxm"),
        (
            ["--strategy", "tp"],
            "unknown strategy 'tp'; choose one of ddp, zero1, zero2, fsdp2, hsdp",
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
    assert "tokens/s per GPU" in out and "all_gather" in out and "fits" in out
