"""FSDP2 with torch.compile: checkpoint, compile, shard gives one graph per identical block with the
checkpoint inside and eager FSDP2's losses bit for bit (aot_eager); the other orders' outcomes as
measured (a frame given up, a silent fall back to eager, an error, the recompute outside the graph);
the benchmark's smoke path; the exercise's judge on the orders' own reports. One launch of 2 ranks."""

import json

import pytest

from distlab.chapters.fsdp_compile import ORDERS, check_equal_to_eager
from distlab.exercises.fsdp_compile import check_parallelize, judge
from distlab.infra.launch import run_ranks


def _tour_and_bench(out_dir: str) -> tuple[dict, dict]:
    from distlab.bench.fsdp_compile import main
    from distlab.chapters.fsdp_compile import tour
    from distlab.runtime import rank_world

    smoke = ["--device", "cpu", "--preset", "tiny", "--steps", "3", "--dtype", "fp32", "--backend", "aot_eager"]
    bench = main([*smoke, "--out", f"{out_dir}/rank{rank_world()[0]}.json"])
    return tour(), bench


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench")
    results = run_ranks(_tour_and_bench, nprocs=2, args=(str(out_dir),), timeout=240, quiet=True)
    return [tour for tour, _ in results], [bench for _, bench in results], out_dir


def test_checkpoint_compile_shard_compiles_one_graph_for_both_blocks(ranks):
    for runs in ranks[0]:
        run = runs["checkpoint, compile, shard"]
        assert len(run["graphs"]) == 1 and run["graph_breaks"] == [] and run["frames_given_up"] == 0
        graph = run["graphs"][0]
        assert graph["checkpoint_inside"]
        assert graph["inputs"] == 1 + 12  # the activation and the block's 12 parameters: not baked in
        assert graph["calls"] == 2 * 3  # 2 blocks x 3 steps; the recompute runs inside its backward
        assert run["entries"]["CheckpointWrapper.forward"] == 1  # one cache entry serves both instances
        assert run["fsdp_units"] == 3 and run["keys_as_plain_model"]


def test_every_order_that_runs_gives_eager_losses_bit_for_bit(ranks):
    for runs in ranks[0]:
        diffs = check_equal_to_eager(runs, tolerance=0.0)
        assert set(diffs) == set(ORDERS) - {
            "eager",
            "shard blocks, checkpoint, compile (replace, fullgraph), shard root",
        }


def test_the_other_orders_as_measured(ranks):
    runs = ranks[0][0]
    titan = runs["checkpoint, compile (replace, fullgraph), shard"]
    assert len(titan["graphs"]) == 1 and titan["first_key"] == "blocks.0._orig_mod.ln1.weight"
    assert not titan["keys_as_plain_model"]
    after = runs["checkpoint, shard, compile"]  # _call_impl is skipped: FSDP's hooks stay outside either way
    assert len(after["graphs"]) == 1 and after["graph_breaks"] == []
    whole = runs["checkpoint, shard, compile the whole model"]
    assert whole["frames_given_up"] == 1 and whole["entries"]["GPT.forward"] == 0
    assert whole["graph_breaks"] == ["Attempted to call function marked as skipped"]
    assert any("graph break in a for/while loop" in why for why in whole["why_given_up"])
    assert len(whole["graphs"]) == 1  # the blocks' own frames are still compiled, one graph
    silent = runs["shard blocks, checkpoint, compile, shard root"]
    assert silent["graphs"] == [] and silent["graph_breaks"] == ["Attempted to call function marked as skipped"]
    loud = runs["shard blocks, checkpoint, compile (replace, fullgraph), shard root"]
    assert loud["error"] == "Unsupported: Attempted to call function marked as skipped"
    first = runs["compile, checkpoint, shard"]
    assert len(first["graphs"]) == 1 and not first["graphs"][0]["checkpoint_inside"]
    assert first["graphs"][0]["calls"] == 2 * 2 * 3  # forward and recompute, 2 blocks, 3 steps


def test_bench_smoke_path(ranks):
    benches, out_dir = ranks[1], ranks[2]
    for rank, bench in enumerate(benches):
        eager, compiled = bench["runs"]
        assert eager["unique_graphs"] == 0 and compiled["unique_graphs"] == 1
        assert bench["comparison"]["loss_max_abs_diff"] == 0.0  # aot_eager, fp32
        written = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert written["provenance"]["command"].startswith("python -m distlab.bench.fsdp_compile --device cpu")


def test_judge_on_the_orders_reports(ranks):
    runs = ranks[0][0]
    judge(runs["checkpoint, compile, shard"], runs["eager"])
    failures = {
        "checkpoint, compile (replace, fullgraph), shard": "state-dict keys changed",
        "compile, checkpoint, shard": "no checkpoint inside",
        "shard blocks, checkpoint, compile, shard root": "handed no graph",
        "shard blocks, checkpoint, compile (replace, fullgraph), shard root": "failed",
    }
    for name, says in failures.items():
        with pytest.raises(AssertionError, match=says):
            judge(runs[name], runs["eager"])
    with pytest.raises(ValueError, match="must be a function"):
        check_parallelize("apply_compile")
