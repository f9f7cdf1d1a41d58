"""FSDP2 on our GPT: shards, averaging, meta init, resharding, mixed precision, hybrid sharding,
each checked against a single-process reference."""

import pytest

from distlab.chapters import fsdp2
from distlab.errors import UserError
from distlab.infra import experiment
from distlab.infra.launch import run_ranks
from distlab.parallel import apply_fsdp


def _refused_by_apply_fsdp(seed: int) -> str | None:
    """apply_fsdp on a GPT built from ``seed``: the UserError's message, or None if it sharded."""
    try:
        apply_fsdp(experiment.gpt("tiny", seed))
    except UserError as error:
        return str(error)
    return None


def _two_rank_checks():
    import torch.distributed as dist

    out = {
        "shards": fsdp2.shard_table(),
        "grad_diff": fsdp2.gradient_check(),
        "meta_diff": fsdp2.meta_init_equals_plain(),
        "resharding": {root: fsdp2.resharding(True, root) for root in (False, None, True)},
        "no_reshard": fsdp2.resharding(False, False),
        "mp": fsdp2.mixed_precision_dtypes(),
        "ops": {m: fsdp2.op_dtypes(m) for m in ("policy", "autocast")},
        "variants": fsdp2.policy_variants(),
        "seeds": fsdp2.different_seeds(),
        "refused": _refused_by_apply_fsdp(seed=dist.get_rank()),  # a seed per rank
        "accepted": _refused_by_apply_fsdp(seed=7),  # the same seed everywhere
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


def test_apply_fsdp_keeps_the_root_whole_and_gathers_only_the_blocks_in_backward(two):
    kept, unset, forced = (two[0]["resharding"][root] for root in (False, None, True))
    blocks = len(kept["whole_after_forward"]) - 1
    assert kept["whole_after_forward"]["root"] > 0  # plain tensors after forward: not resharded
    assert all(n == 0 for unit, n in kept["whole_after_forward"].items() if unit != "root")  # blocks: shards again
    assert (kept["forward all-gathers"], kept["backward all-gathers"]) == (blocks + 1, blocks)
    assert kept["backward reduce-scatters"] == blocks + 1
    assert unset == kept  # False on the root is FSDP2's own choice when it is left unset


def test_an_explicit_true_on_the_root_is_honoured_and_costs_one_all_gather(two):
    kept, forced = two[0]["resharding"][False], two[0]["resharding"][True]
    assert forced["whole_after_forward"]["root"] == 0
    assert forced["backward all-gathers"] == kept["backward all-gathers"] + 1


def test_no_reshard_keeps_every_unit_whole_and_gathers_nothing_in_backward(two):
    r = two[0]["no_reshard"]
    assert all(n > 0 for n in r["whole_after_forward"].values()) and r["backward all-gathers"] == 0


def test_ranks_with_different_weights_train_a_stitched_model_unless_checked(two):
    for r in two:
        seeds = r["seeds"]
        assert seeds["rows_from"] == {0: 33, 1: 32}  # rank 0's rows, then rank 1's: neither rank's model
        assert len(seeds["losses"]) == 3 and seeds["losses"][-1] < seeds["losses"][0]  # and it trains, silently
        assert "rank 1's 'wte.weight' differs from rank 0's" in seeds["caught"]
        assert "differs from rank 0's" in r["refused"]  # apply_fsdp checks by default
        assert r["accepted"] is None


def test_meta_device_init_gives_the_plain_weights(two):
    assert max(r["meta_diff"] for r in two) == 0.0


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards_and_grads(two):
    mp = two[0]["mp"]
    assert mp["parameter inside forward"] == "bfloat16" and mp["logits"] == "bfloat16"
    assert mp["sharded parameter (the master weight)"] == "float32"
    assert mp["gradient of the shard"] == "float32" and mp["AdamW moments"] == "float32"
    assert mp["loss"] == "float32"  # the model computes it from logits.float()


def _ran_as(rows, phase, op):
    return {r["dtypes"] for r in rows if r["phase"] == phase and r["op"] == op}


def test_under_the_policy_every_op_runs_in_bf16_but_the_loss_and_the_reduction(two):
    policy, autocast = two[0]["ops"]["policy"], two[0]["ops"]["autocast"]
    for op in ("aten.native_layer_norm", "aten.addmm", "aten.gelu", "aten.mm", "c10d._allgather_base_"):
        assert _ran_as(policy, "forward", op) == {"bf16 -> bf16"}, op
    assert _ran_as(policy, "forward", "aten.add") - {"int64, int64 -> int64", "int64 -> int64"} == {"bf16 -> bf16"}
    assert _ran_as(policy, "forward", "aten._log_softmax") == {"fp32 -> fp32"}
    assert _ran_as(policy, "backward", "c10d._reduce_scatter_base_") == {"fp32 -> fp32"}
    assert _ran_as(policy, "optimizer", "aten._fused_adamw_") == {"fp32 -> (in place)"}
    # autocast (labs 1-3) is op-level: LayerNorm and the residual stream stay fp32
    assert _ran_as(autocast, "forward", "aten.native_layer_norm") == {"fp32 -> fp32"}
    assert "fp32, bf16 -> fp32" in _ran_as(autocast, "forward", "aten.add")


def test_output_dtype_casts_unit_outputs_and_cast_forward_inputs_changes_nothing_here(two):
    rows = {r["policy"]: {k: v for k, v in r.items() if k != "policy"} for r in two[0]["variants"]}
    assert rows["cast_forward_inputs=False"] == rows["the labs' policy"]  # int64 ids; bf16 between blocks
    assert rows["output_dtype=fp32 on the root"]["logits"] == "float32"
    every = rows["output_dtype=fp32 on every unit"]
    assert every["block 0 returns"] == "float32" and every["block 1 computes on"] == "bfloat16"
    assert "error" in every  # ln_f, inside the root, meets the last block's fp32 output (CPU: "mixed dtype")


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown strategy 'zero4'; choose one of single, ddp, .*fsdp2-bf16"):
        experiment.strategy("zero4")
    with pytest.raises(ValueError, match="unknown strategy 'fsdp2_bf16'"):  # hyphens, everywhere
        fsdp2.train("fsdp2_bf16")
    assert set(fsdp2.STRATEGIES) <= set(experiment.STRATEGIES)
