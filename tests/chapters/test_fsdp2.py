"""FSDP2 on our GPT: shards, averaging, meta init, resharding, mixed precision, hybrid sharding,
each checked against a single-process reference."""

import pytest

from distlab.chapters import fsdp2
from distlab.infra import experiment
from distlab.infra.launch import run_ranks


def _two_rank_checks():
    out = {
        "shards": fsdp2.shard_table(),
        "grad_diff": fsdp2.gradient_check(),
        "meta_diff": fsdp2.meta_init_equals_plain(),
        "alive": (
            fsdp2.unsharded_between_forward_and_backward("tiny", True),
            fsdp2.unsharded_between_forward_and_backward("tiny", False),
        ),
        "mp": fsdp2.mixed_precision_dtypes(),
    }
    for strategy in ("ddp", "fsdp2", "fsdp2-no-reshard"):
        out[strategy] = fsdp2.train(strategy, "tiny", steps=10)
    out["tracked"] = fsdp2.train("fsdp2", "tiny", steps=3, track_peak=True)  # the benchmark's run
    return out


def _four_rank_checks():
    return {s: fsdp2.train(s, "tiny", steps=10) for s in ("fsdp2", "hsdp")}


@pytest.fixture(scope="module")
def single():
    return fsdp2.train("single", "tiny", steps=10)


@pytest.fixture(scope="module")
def two(single):
    return run_ranks(_two_rank_checks, nprocs=2, timeout=300, quiet=True)


@pytest.fixture(scope="module")
def four(single):
    return run_ranks(_four_rank_checks, nprocs=4, timeout=300, quiet=True)


def test_every_parameter_is_a_dim0_shard(two):
    for rank, result in enumerate(two):
        for row in result["shards"]:
            rows = row["global"][0]
            expected = min(-(-rows // 2), rows - rank * -(-rows // 2))  # ceil split: rank 1 may hold fewer
            assert row["local"] == (expected, *row["global"][1:]), row
            assert row["placements"] == "(Shard(dim=0),)"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2-no-reshard"])
def test_two_ranks_train_like_one_process(two, single, strategy):
    assert two[0][strategy]["losses"] == pytest.approx(single["losses"], rel=1e-5)


@pytest.mark.parametrize("strategy", ["fsdp2", "hsdp"])
def test_four_ranks_and_hybrid_sharding_train_like_one_process(four, single, strategy):
    assert four[0][strategy]["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_gradients_are_averaged_not_summed(two):
    # a sum over 2 ranks would be off by the size of the gradients themselves (~1e-2 here)
    assert max(r["grad_diff"] for r in two) < 1e-6


def test_model_state_per_rank_is_halved(two):
    ddp, fsdp = two[0]["ddp"]["state_bytes"], two[0]["fsdp2"]["state_bytes"]
    for part in ("params", "grads", "optimizer"):
        assert fsdp[part] / ddp[part] == pytest.approx(0.5, abs=0.01), part  # padding: a little over half
    assert fsdp["total"] <= 0.52 * ddp["total"]


def test_the_benchmark_tracks_the_peak_of_the_last_step_only(two):
    tracked, untracked = two[0]["tracked"], two[0]["fsdp2"]
    assert tracked["losses"] == untracked["losses"][:3]  # tracking changes nothing it measures
    assert untracked["peak"] is None and tracked["peak"]["Total"] > tracked["state_bytes"]["params"]
    assert tracked["state_bytes"] == untracked["state_bytes"]


def test_reshard_after_forward_frees_the_gathered_blocks(two):
    freed, kept = two[0]["alive"]
    assert freed == 0 and kept > 0


def test_meta_device_init_gives_the_plain_weights(two):
    assert max(r["meta_diff"] for r in two) == 0.0


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards_and_grads(two):
    mp = two[0]["mp"]
    assert mp["parameter inside forward"] == "torch.bfloat16"
    assert mp["sharded parameter (kept)"] == "torch.float32"
    assert mp["gradient of the shard"] == "torch.float32"


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown strategy 'zero4'; choose one of single, ddp, .*fsdp2-bf16"):
        experiment.strategy("zero4")
    with pytest.raises(ValueError, match="unknown strategy 'fsdp2_bf16'"):  # hyphens, everywhere
        fsdp2.train("fsdp2_bf16")
    assert set(fsdp2.STRATEGIES) <= set(experiment.STRATEGIES)
