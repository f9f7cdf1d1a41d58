"""Activation checkpointing: same gradients in every mode, fewer saved bytes on the
shakespeare model, policies refused when built wrong, the recorded benchmark and its
plumbing, the exercise's checker. The page (book/activation_checkpointing.md) asserts on
every build what it runs: the hand-written wrapper's gradients, the tiny model's saved
bytes in every mode, what the default policy and the wrong ones save, and FSDP2 in both
orders (lab 5 itself: tests/labs/test_lab5_activation_ckpt.py)."""

import json
import shlex

import pytest
import torch

from distlab.bench.ac import POLICIES
from distlab.chapters.activation_checkpointing import (
    activation_memory,
    build,
    gradients,
)
from distlab.exercises import check_attention_only_policy
from distlab.infra.paths import REPO_ROOT
from distlab.model import GPT, preset
from distlab.parallel import (
    SAVE_MATMULS_AND_ATTENTION,
    apply_activation_checkpointing,
    save_ops_policy,
)
from distlab.tools.memory_calculator import activation_bytes
from support.exercises import passes

aten = torch.ops.aten


def _batch(cfg, batch, seed=0):
    return torch.randint(
        0,
        cfg.vocab_size,
        (2, batch, cfg.block_size),
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize("preset_name,batch", [("tiny", 8), ("shakespeare", 1)])
@pytest.mark.parametrize(
    "mode,every", [("full", 1), ("full", 2), ("selective", 1), ("selective", 2)]
)
def test_gradients_equal_those_without_checkpointing(preset_name, batch, mode, every):
    idx, targets = _batch(preset(preset_name), batch)
    reference = gradients(build(preset_name), idx, targets)
    checkpointed = gradients(build(preset_name, mode, every), idx, targets)
    # fp32: the recomputation repeats the same kernels
    for got, want in zip(checkpointed, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("preset_name,batch", [("shakespeare", 1)])  # the page: tiny, 8
def test_saved_bytes_match_the_formula_and_the_tracker(preset_name, batch):
    cfg = preset(preset_name)
    idx, targets = _batch(cfg, batch)
    none, full, selective = (
        activation_memory(build(preset_name, mode), idx, targets)
        for mode in ("none", "full", "selective")
    )
    for measured, checkpointing in ((none, False), (full, True)):
        assert (
            measured["hooks"]
            == activation_bytes(cfg, batch, cfg.block_size, checkpointing)["saved"]
        )
        # the tracker also counts the returned fp32 loss
        assert measured["saved"] == measured["hooks"] + 4
    assert full["saved"] <= 0.20 * none["saved"]
    # selective caches its saved outputs outside autograd: the hooks miss them, the
    # tracker does not
    assert selective["hooks"] == full["hooks"]
    assert full["saved"] < selective["saved"] < none["saved"]
    assert full["peak"] < selective["peak"] < none["peak"]


def test_policies_that_name_packets_are_refused_when_built():
    with pytest.raises(TypeError, match="overload"):
        save_ops_policy([aten.mm, aten.addmm])


def test_bad_arguments_and_plain_state_dict_keys():
    with pytest.raises(ValueError, match="unknown activation checkpointing mode"):
        apply_activation_checkpointing(GPT(preset("tiny")), "ful")
    with pytest.raises(ValueError, match="every must be"):
        apply_activation_checkpointing(GPT(preset("tiny")), "full", every=0)
    plain = GPT(preset("tiny")).state_dict()
    wrapped = apply_activation_checkpointing(GPT(preset("tiny")), "selective")
    # the wrapper's name part is stripped
    assert list(wrapped.state_dict()) == list(plain)
    wrapped.load_state_dict(plain)
    assert all(str(op).endswith(".default") for op in SAVE_MATMULS_AND_ATTENTION)


def test_recorded_benchmark_is_complete_and_rerunnable():
    result = json.loads((REPO_ROOT / "results" / "ac_bench.json").read_text())
    command = shlex.split(result["provenance"]["command"])
    assert command[:3] == ["python", "-m", "distlab.bench.ac"]
    # the recorded options still parse (nothing is run with --help)
    from distlab.bench.ac import main

    with pytest.raises(SystemExit) as exit_info:
        main([*command[3:], "--help"])
    assert exit_info.value.code == 0
    runs = result["single_process"]
    assert [(r["mode"], r["every"]) for r in runs] == [
        (mode, every) for _, mode, every in POLICIES
    ]
    for run in runs:
        assert (
            run["grad_max_abs_diff"] <= 1e-6
            and run["median_step_s"] > 0
            and run["saved"] > 0
        )
    assert {r["mode"] for r in result["fsdp2"]} == {"none", "full", "selective"}


def test_the_benchmark_runs_its_models_on_the_device_it_is_given(monkeypatch):
    from distlab.bench import ac

    # none and full: enough to see the plumbing
    moved, policies = [], [POLICIES[0], POLICIES[3]]
    build_on_cpu = ac.build
    monkeypatch.setattr(
        ac, "build", lambda *args: _noting_moves(build_on_cpu(*args), moved)
    )
    monkeypatch.setattr(ac, "POLICIES", policies)
    runs = ac.single_process("tiny", 2, 1, warmup=0, device="cpu")
    assert moved == [torch.device("cpu")] * 3  # the reference, then each policy's model
    assert [(r["mode"], r["every"]) for r in runs] == [("none", 1), ("full", 1)]
    assert all(
        r["grad_max_abs_diff"] <= 1e-6 and r["saved"] > 0 and len(r["step_s"]) == 1
        for r in runs
    )
    with pytest.raises(SystemExit):
        ac.main(["--device", "tpu"])  # only cpu and cuda


def _noting_moves(model, moved):
    """``model``, whose ``.to(device)`` also notes the device in ``moved``."""
    to = model.to
    model.to = lambda device: moved.append(torch.device(device)) or to(device)
    return model


# ------------------------------------------------- Activation checkpointing, exercise 2
@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_attention_only_policy_checker(capsys):
    policy = save_ops_policy(
        [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    )
    assert "recomputes every matrix product" in passes(
        check_attention_only_policy, policy, capsys=capsys
    )
    with pytest.raises(AssertionError, match=r"also saves aten.addmm.default \(8x\)"):
        # the default keeps the matrix products too
        check_attention_only_policy(save_ops_policy())
    with pytest.raises(ValueError, match="saved no operator's output"):
        # the Linears run addmm
        check_attention_only_policy(save_ops_policy([torch.ops.aten.mm.default]))
    with pytest.raises(ValueError, match="must be a function"):
        check_attention_only_policy(
            [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
        )


# ------------------------------------------- the timeline, the GPU run the page reads
def test_recorded_gpu_benchmark_is_complete_and_rerunnable():
    result = json.loads((REPO_ROOT / "results" / "ac_bench_gpu.json").read_text())
    command = shlex.split(result["provenance"]["command"])
    assert command[:3] == ["python", "-m", "distlab.bench.ac"]
    assert command[command.index("--device") + 1] == "cuda"
    assert result["provenance"]["gpu_count"] >= 1
    runs = result["single_process"]
    assert [(r["mode"], r["every"]) for r in runs] == [
        (mode, every) for _, mode, every in POLICIES
    ]
    assert all(len(r["step_s"]) >= 5 and r["grad_max_abs_diff"] <= 1e-6 for r in runs)


def test_the_work_clock_counts_flops_for_products_and_elements_otherwise():
    from distlab.tools.ac_timeline import _work

    m, k, n = 4, 8, 16
    shapes = ((torch.Size([n]), torch.Size([m, k]), torch.Size([k, n])),)
    assert _work(aten.addmm.default, *shapes, torch.Size([m, n])) == 2 * m * k * n
    assert _work(aten.gelu.default, (torch.Size([m, n]),), torch.Size([m, n])) == m * n
    q = torch.Size([2, 4, 8, 16])  # (B, H, T, D): two products of T x T x D
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert _work(sdpa, (q, q, q), (q,)) == 4 * 2 * 4 * 8 * 8 * 16


class _Event:
    def __init__(self, name, start, end):
        self.name = name
        self.time_range = type("Range", (), {"start": start, "end": end})()


def test_hook_sequence_names_who_issued_each_all_gather():
    from distlab.tools.ac_timeline import hook_sequence

    events = [
        _Event("FSDP::pre_forward (blocks.0)", 0, 3),
        _Event("FSDP::all_gather (blocks.0)", 1, 2),
        _Event("block forward (0)", 4, 5),
        _Event("FSDP::all_gather (blocks.1)", 6, 7),  # issued by no hook seen
        _Event("backward", 10, 30),
        _Event("FSDP::pre_forward (blocks.0)", 11, 12),
        _Event("block forward (0)", 13, 14),
        _Event("FSDP::post_backward_reduce (blocks.0)", 15, 16),
        _Event("FSDP::all_gather ()", 17, 18),  # the root: not a block
    ]
    assert hook_sequence(events) == [
        ("all-gather", 0, "pre_forward, in forward"),
        ("forward", 0, ""),
        ("all-gather", 1, "?, in forward"),
        ("pre-forward hook", 0, "in backward"),
        ("recompute", 0, ""),
        ("reduce-scatter", 0, ""),
    ]


def test_the_timeline_model_checkpoints_every_kth_block():
    from distlab.tools.ac_timeline import timeline_model

    wrapped = [
        hasattr(b, "_checkpoint_wrapped_module")
        for b in timeline_model("full", 2).blocks
    ]
    assert wrapped == [True, False, True, False]
