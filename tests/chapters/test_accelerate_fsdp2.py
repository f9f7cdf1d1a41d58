"""The claims of book/accelerate_fsdp2.md: Accelerate's own converter and launcher code on the
FSDP YAML keys (no ranks), then one launch of 2 gloo ranks that prepares the tiny GPT under three
config files and four loading setups, with the exercise checker's verdict on two answers."""

import pytest
import torch
import yaml
from accelerate.commands.to_fsdp2 import convert_config_to_fsdp2
from accelerate.utils import FullyShardedDataParallelPlugin

from distlab.chapters import accelerate_fsdp2 as demo
from distlab.exercises.accelerate_fsdp2 import problems_on_this_rank, verdict
from distlab.infra.launch import run_ranks


def _env_of(tmp_path, fsdp_config: dict) -> dict:
    config = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": fsdp_config}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return demo.launcher_env(tmp_path / "c.yaml")


def test_the_converter_maps_sharding_strategy_to_a_bool_and_drops_fsdp1_only_keys():
    new = convert_config_to_fsdp2(yaml.safe_load(demo.FSDP1_CONFIG))["fsdp_config"]
    assert new["fsdp_version"] == 2 and new["fsdp_reshard_after_forward"] is False  # SHARD_GRAD_OP
    assert not {"fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_sync_module_states"} & set(new)
    hybrid = convert_config_to_fsdp2({"fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}})
    assert hybrid["fsdp_config"] == {"fsdp_reshard_after_forward": True, "fsdp_version": 2}  # replication gone


def test_an_old_numeric_sharding_strategy_passes_the_converter_and_fails_or_succeeds_by_luck(tmp_path):
    for number, outcome in ((1, True), (2, "invalid truth value 2")):  # 1 FULL_SHARD, 2 SHARD_GRAD_OP
        new = convert_config_to_fsdp2({"fsdp_config": {"fsdp_sharding_strategy": number}})["fsdp_config"]
        assert new["fsdp_reshard_after_forward"] == number  # copied unchecked
        env = _env_of(tmp_path, new)
        if outcome is True:
            assert demo.plugin_from_env(env).reshard_after_forward is True
        else:
            with pytest.raises(ValueError, match=outcome):
                demo.plugin_from_env(env)


def test_the_launcher_turns_cpu_ram_efficient_loading_on_but_the_plugin_alone_does_not(tmp_path):
    env = _env_of(tmp_path, {"fsdp_version": 2})
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true" and "FSDP_STATE_DICT_TYPE" not in env
    plugin = demo.plugin_from_env(env)
    assert plugin.cpu_ram_efficient_loading and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.reshard_after_forward is True and plugin.auto_wrap_policy is None
    assert demo.plugin_from_env({"FSDP_VERSION": "2"}).cpu_ram_efficient_loading is False  # as under torchrun
    with pytest.raises(ValueError, match="not supported with FSDP2"):
        FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=2)  # fully_shard would take it


def test_each_config_and_loading_setup_prepared_on_two_ranks(tmp_path):
    files = {"minimal": demo.MINIMAL_CONFIG, "blocks": demo.BLOCKS_CONFIG}
    envs = {}
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        envs[name] = demo.launcher_env(tmp_path / f"{name}.yaml")
    converted = convert_config_to_fsdp2(yaml.safe_load(demo.FSDP1_CONFIG))  # the CLI's own function
    (tmp_path / "converted.yaml").write_text(yaml.safe_dump(converted))
    envs["converted"] = demo.launcher_env(tmp_path / "converted.yaml")
    checkpoint = str(tmp_path / "model.pt")
    demo.save_checkpoint(checkpoint)

    def right(model, optimizer):  # the page's solution to exercise 3
        held = [p for group in optimizer.param_groups for p in group["params"]]
        ids = {id(p) for p in held}
        problems = [f"{n} is not in the optimizer" for n, p in model.named_parameters() if id(p) not in ids]
        return problems + (["duplicates"] if len(ids) < len(held) else [])

    def everything():
        out = demo.tour(envs, checkpoint, str(tmp_path / "saved"))
        out["right"] = problems_on_this_rank(right, envs["minimal"], checkpoint)
        out["silent"] = problems_on_this_rank(lambda model, optimizer: [], envs["minimal"], checkpoint)
        return out

    r0, r1 = run_ranks(everything, nprocs=2, init_group=False, quiet=True, timeout=180)
    minimal, blocks, conv = (r0["configs"][n] for n in ("minimal", "blocks", "converted"))
    # reshard_after_forward reaches only auto-wrapped units; the root and the ln_f tail are never resharded
    assert minimal["units"] == ["root", "ln_f"] and not any(minimal["resharded after forward"].values())
    assert blocks["resharded after forward"] == {"root": False, "blocks.0": True, "blocks.1": True, "ln_f": False}
    assert (blocks["backward all-gathers"], conv["backward all-gathers"]) == (2, 0)
    assert conv["checkpoint wrappers"] == 2 and conv["preserve_rng_state"] == [False]
    assert "blocks.0._checkpoint_wrapped_module" in conv["units"]  # FSDP(CheckpointWrapper(FSDP(Block)))
    # the state-dict type decides the files; a full dict exists on rank 0 only
    assert "pytorch_model_fsdp_0/__1_0.distcp" in blocks["files"] and "pytorch_model_fsdp.bin" in conv["files"]
    assert (conv["saved tensors"], r1["configs"]["converted"]["saved tensors"]) == (29, 0)
    full = torch.load(tmp_path / "saved" / "converted" / "pytorch_model_fsdp.bin", weights_only=True)
    plain = demo.GPT(demo.preset("tiny")).state_dict()  # one process loads it: the plain model's keys and shapes
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in plain.items()}
    # cpu_ram_efficient_loading without tie_weights splits the tied matrix and never steps lm_head
    assert not minimal["lm_head tied to wte"] and not minimal["lm_head stepped"] and blocks["lm_head stepped"]
    loading0, loading1 = r0["loading"], r1["loading"]
    for setup in demo.LOADING_SETUPS:
        assert loading0[setup]["max diff"] == loading1[setup]["max diff"] == 0.0  # exact, every setup
    empty = loading0["rank 0 reads, others empty"]
    assert empty["broadcasts"] == empty["scatters"] == 29 and empty["broadcast bytes"] == 450_048
    assert loading1["rank 0 reads, others empty"]["changed by a step"] == 28
    meta = loading1["rank 0 reads, others on meta"]
    assert meta["held before"] == 0 and (meta["optimizer holds"], meta["changed by a step"]) == (1, 1)
    assert meta["held names"] == ["ln_f.bias"]  # every meta data_ptr() is 0: all map to the last name
    # the checker's verdict: the right answer passes, a silent one is caught
    assert "silent on the recipe" in verdict([r0["right"], r1["right"]])
    with pytest.raises(AssertionError, match="find_problems returned \\[\\]"):
        verdict([r0["silent"], r1["silent"]])
