"""FSDP2 on our GPT: what the page (book/fsdp2.md) does not run. The page's launches
(shards, averaging, meta init, resharding, mixed precision, different seeds, training on
2 and 4 ranks and HSDP against one process) are asserted by the page itself on every
build. Here: apply_fsdp's own refusal of ranks with different weights, the benchmark's
peak tracking, bad strategy names, and the readers behind the page's timeline and
benchmark table on fixed inputs."""

import pytest

from distlab.chapters import fsdp2
from distlab.errors import UserError
from distlab.infra import experiment
from distlab.infra.launch import run_ranks
from distlab.parallel import apply_fsdp

STEPS = 2


def _refused_by_apply_fsdp(seed: int) -> str | None:
    """apply_fsdp on a GPT built from ``seed``: the UserError's message, or None if
    it sharded."""
    try:
        apply_fsdp(experiment.gpt("tiny", seed))
    except UserError as error:
        return str(error)
    return None


def _two_rank_checks():
    import torch.distributed as dist

    return {
        "refused": _refused_by_apply_fsdp(seed=dist.get_rank()),  # a seed per rank
        "accepted": _refused_by_apply_fsdp(seed=7),  # the same seed everywhere
        "untracked": fsdp2.train("fsdp2", "tiny", steps=STEPS),
        # the benchmark's run
        "tracked": fsdp2.train("fsdp2", "tiny", steps=STEPS, track_peak=True),
    }


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_rank_checks, nprocs=2, timeout=300, quiet=True)


def test_apply_fsdp_refuses_ranks_with_different_weights(two):
    for r in two:
        assert "differs from rank 0's" in r["refused"]  # apply_fsdp checks by default
        assert r["accepted"] is None


def test_the_benchmark_tracks_the_peak_of_the_last_step_only(two):
    tracked, untracked = two[0]["tracked"], two[0]["untracked"]
    # tracking changes nothing it measures
    assert tracked["losses"] == untracked["losses"]
    assert (
        untracked["peak"] is None
        and tracked["peak"]["Total"] > tracked["state_bytes"]["params"]
    )
    assert tracked["state_bytes"] == untracked["state_bytes"]


def test_unknown_strategy_is_refused():
    with pytest.raises(
        ValueError,
        match="unknown strategy 'zero4'; choose one of single, ddp, .*fsdp2-bf16",
    ):
        experiment.strategy("zero4")
    # hyphens, everywhere
    with pytest.raises(ValueError, match="unknown strategy 'fsdp2_bf16'"):
        fsdp2.train("fsdp2_bf16")
    assert set(fsdp2.STRATEGIES) <= set(experiment.STRATEGIES)


# the figures' and tables' readers, on fixed inputs (the page draws them from a run)
SPANS = [  # (name, start, end): one block, resharded after forward, and the root
    ("FSDP::all_gather", 0, 1),
    ("FSDP::pre_forward (blocks.0)", 1, 3),
    ("FSDP::all_gather (blocks.0)", 1, 2),
    ("FSDP::post_forward (blocks.0)", 4, 5),
    ("FSDP::pre_backward (blocks.0)", 6, 8),
    ("FSDP::all_gather (blocks.0)", 6, 7),
    ("FSDP::post_backward_accumulate (blocks.0)", 9, 9.5),
    ("FSDP::post_backward_reshard (blocks.0)", 9.5, 10),
    ("FSDP::post_backward_reduce (blocks.0)", 10, 11),
    ("FSDP::post_backward_reshard", 11, 12),
    ("FSDP::post_backward_reduce", 12, 13),
]


def test_unit_bars_reads_whole_spans_and_phases_from_fsdp2_ranges():
    from distlab.figures.fsdp2_views import most_held, unit_bars

    bars = unit_bars(SPANS)
    block = {(kind, s, e) for kind, s, e in bars["blocks.0"]}
    # gathered again in backward, so the post-forward freed it: two whole spans
    assert ("held whole", 2, 5) in block and ("held whole", 7, 10) in block
    assert ("forward", 3, 4) in block and ("backward", 8, 9) in block
    assert ("reduce-scatter", 10, 11) in block
    assert ("held whole", 1, 12) in set(bars["root"])
    assert most_held(SPANS) == 2  # the root and the block


def test_bench_verdicts_need_spreads_apart_and_4_ranks_on_2_cores_are_marked():
    from distlab.figures.fsdp2_views import bench_rows, verdict

    assert verdict({"min": 3, "max": 4}, {"min": 1, "max": 2}) == "faster"
    assert verdict({"min": 1, "max": 2}, {"min": 3, "max": 4}) == "slower"
    assert verdict({"min": 1, "max": 3}, {"min": 2, "max": 4}) == "within spread"
    run = {
        "tokens_per_s": {"median": 2, "min": 1, "max": 3},
        "state_per_rank": [{"total": 10}],
        "peak_per_rank": [{"Total": 20}],
    }
    bench = {
        "provenance": {"cpu_count": 2},
        "runs": [{**run, "strategy": "ddp", "world_size": n} for n in (2, 4)],
    }
    assert [row["ranks"] for row in bench_rows({16: bench})] == [2, "4*"]
