"""FSDP2 on our GPT: what the page (book/fsdp2.md) does not run. The page's launches
(shards, averaging, meta init, resharding, mixed precision, different seeds, training on
2 and 4 ranks and HSDP against one process) are asserted by the page itself on every
build. Here: apply_fsdp's own refusal of ranks with different weights, the benchmark's
peak tracking, and bad strategy names."""

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
