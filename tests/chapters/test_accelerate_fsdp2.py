"""What book/accelerate_fsdp2.md does not run: Accelerate's own converter and launcher
code on FSDP YAML keys it does not show (no ranks), and the exercise checker's verdict
on wrong answers. The page asserts its launch (three config files and four loading
setups on 2 gloo ranks) and runs the checker on the right answer."""

import pytest
import yaml
from accelerate.commands.to_fsdp2 import convert_config_to_fsdp2
from accelerate.utils import FullyShardedDataParallelPlugin

from distlab.chapters import accelerate_fsdp2 as demo
from distlab.exercises.accelerate_fsdp2 import EXPECTED, verdict


def _env_of(tmp_path, fsdp_config: dict) -> dict:
    config = {
        "distributed_type": "FSDP",
        "num_processes": 2,
        "fsdp_config": fsdp_config,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return demo.launcher_env(tmp_path / "c.yaml")


def test_the_converter_maps_sharding_strategy_to_a_bool_and_drops_fsdp1_only_keys():
    new = convert_config_to_fsdp2(yaml.safe_load(demo.FSDP1_CONFIG))["fsdp_config"]
    # SHARD_GRAD_OP
    assert new["fsdp_version"] == 2 and new["fsdp_reshard_after_forward"] is False
    assert not {
        "fsdp_sharding_strategy",
        "fsdp_backward_prefetch",
        "fsdp_sync_module_states",
    } & set(new)
    hybrid = convert_config_to_fsdp2(
        {"fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}}
    )
    # replication gone
    assert hybrid["fsdp_config"] == {
        "fsdp_reshard_after_forward": True,
        "fsdp_version": 2,
    }


def test_an_old_numeric_sharding_strategy_passes_the_converter_and_fails_or_succeeds_by_luck(  # noqa: E501
    tmp_path,
):
    # 1 FULL_SHARD, 2 SHARD_GRAD_OP
    for number, outcome in ((1, True), (2, "invalid truth value 2")):
        new = convert_config_to_fsdp2(
            {"fsdp_config": {"fsdp_sharding_strategy": number}}
        )["fsdp_config"]
        assert new["fsdp_reshard_after_forward"] == number  # copied unchecked
        env = _env_of(tmp_path, new)
        if outcome is True:
            assert demo.plugin_from_env(env).reshard_after_forward is True
        else:
            with pytest.raises(ValueError, match=outcome):
                demo.plugin_from_env(env)


def test_the_launcher_turns_cpu_ram_efficient_loading_on_but_the_plugin_alone_does_not(
    tmp_path,
):
    env = _env_of(tmp_path, {"fsdp_version": 2})
    assert (
        env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
        and "FSDP_STATE_DICT_TYPE" not in env
    )
    plugin = demo.plugin_from_env(env)
    assert (
        plugin.cpu_ram_efficient_loading
        and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    )
    assert plugin.reshard_after_forward is True and plugin.auto_wrap_policy is None
    # as under torchrun
    assert (
        demo.plugin_from_env({"FSDP_VERSION": "2"}).cpu_ram_efficient_loading is False
    )
    with pytest.raises(ValueError, match="not supported with FSDP2"):
        # fully_shard would take it
        FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=2)


def test_the_checker_catches_a_silent_and_a_noisy_find_problems():
    """The right answer passes on every build of the page (its exercise 3 cell, on 2
    ranks); a silent one is caught where a rank's optimizer is wrong, a noisy one where
    every rank's is right."""
    silent = {setup: [] for setup in EXPECTED}
    with pytest.raises(
        AssertionError,
        match="'rank 0 reads, others empty, no tie_weights', rank 0: .* returned "
        "\\[\\]",
    ):
        verdict([silent, silent])
    noisy = {setup: ["a problem"] for setup in EXPECTED}
    with pytest.raises(
        AssertionError,
        match="'rank 0 reads, others empty', rank 0: every parameter is in the "
        "optimizer",
    ):
        verdict([noisy, noisy])
