"""The single-device baseline chapter's experiments (distlab.chapters.single_device): parameter
counts, model-state and activation bytes, FLOPs per token, and lab 1's MFU, each checked against
an independent count."""

import math

import matplotlib.pyplot as plt
import pytest
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from distlab.chapters.single_device import (
    ISA_MEANING,
    MB,
    activation_table,
    adamw_step_seconds,
    attention_kernel,
    counted_flops_per_token,
    memory_figure,
    mfu_figure,
    model_state_after_one_step,
    parameter_table,
    run_lab1,
)
from distlab.flops import ISA_FLAGS, flops_per_token, matmul_parameters
from distlab.model import GPT, preset


def test_parameter_table_agrees_with_the_tensors_and_the_known_size():
    rows = {row["preset"]: row for row in parameter_table()}
    for name, row in rows.items():
        cfg = preset(name)
        assert (row["L"], row["C"], row["T"]) == (cfg.n_layer, cfg.n_embd, cfg.block_size)
        # the tied head shares wte's tensor: parameters() yields it once
        assert row["formula"] == row["counted"] == sum(p.numel() for p in GPT(cfg).parameters())
    assert rows["shakespeare"]["counted"] == 10_770_816  # the classic shakespeare-char GPT, with biases


def test_model_state_is_16_bytes_per_parameter_plus_a_step_counter_per_tensor():
    model = GPT(preset("tiny"))
    n, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    measured, formula = model_state_after_one_step(preset("tiny"))
    assert measured == formula
    assert (measured["params"], measured["grads"]) == (4 * n, 4 * n)
    assert measured["optimizer"] == 8 * n + 4 * tensors  # exp_avg, exp_avg_sq, and a 4-byte step each
    assert measured["total"] == 16 * n + 4 * tensors


def test_activation_table_matches_the_formula_and_bf16_saves_fewer_bytes():
    (row,) = activation_table(batch=2, presets=("tiny",))
    assert row["preset"] == "tiny" and row["fp32"] == row["formula"]
    # autocast keeps the residual stream and LayerNorm inputs in fp32: fewer bytes, not half
    assert row["fp32"] / 2 < row["bf16"] < row["fp32"]


def test_flop_counter_sees_attention_only_on_the_math_backend():
    cfg = preset("tiny")
    assert counted_flops_per_token(cfg, math_attention=True) == flops_per_token(cfg)
    assert counted_flops_per_token(cfg, math_attention=False) == 6 * matmul_parameters(cfg)  # 6N alone


@pytest.mark.parametrize(
    "kwargs,message",
    [({"dtypes": ["fp16"]}, "unknown dtype 'fp16'"), ({"dtypes": ["fp32"], "steps": 2}, "steps must be at least 3")],
)
def test_run_lab1_refuses_what_it_cannot_measure(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run_lab1(out_dir=tmp_path, **kwargs)


def test_run_lab1_reports_mfu_as_achieved_over_the_measured_peak(tmp_path):
    results = run_lab1(["fp32"], tmp_path, preset_name="tiny", batch=4, steps=3)
    s = results["fp32"]
    assert s["dtype"] == "fp32" and s["tokens_per_s"] > 0 and (tmp_path / "fp32" / "summary.json").is_file()
    # 6N + attention FLOPs per token, times tokens/s, over the peak the run measured
    assert s["achieved_flops_per_s"] == pytest.approx(flops_per_token(preset("tiny")) * s["tokens_per_s"])
    assert s["mfu"] == pytest.approx(s["achieved_flops_per_s"] / s["peak_flops_per_s"]) and 0 < s["mfu"] <= 1
    # the peak was timed in the lab's own process, with its threads, at the end of the run
    assert s["peak_measured_with"] == {
        "threads_per_rank": torch.get_num_threads(),
        "ranks_at_once": 1,
        "float32_matmul_precision": torch.backends.mkldnn.matmul.fp32_precision,  # and the matmul setting
        "tf32": None,
    }
    assert s["datasheet_peak"] is None and s["mfu_of_datasheet_peak"] is None  # a CPU has no datasheet row
    fig = mfu_figure(results, "tiny")
    assert [bar.get_width() for bar in fig.axes[0].patches] == [s["mfu"]]
    plt.close(fig)


def test_an_mfu_that_was_not_recorded_shows_as_such_not_as_zero():
    results = {"fp32": {"mfu": None, "tokens_per_s": 1000.0}}
    fig = mfu_figure(results, "t")
    assert [bar.get_width() for bar in fig.axes[0].patches] == [0.0]
    assert "MFU not recorded" in fig.axes[0].texts[0].get_text()
    plt.close(fig)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_runs_the_cpu_flash_kernel_in_fp32_and_bf16(dtype):
    assert attention_kernel(preset("tiny"), dtype) == "ScaledDotProductFlashAttentionForCpuBackward0"


def test_fused_adamw_against_the_default_which_on_a_cpu_is_neither_fused_nor_foreach():
    params = list(GPT(preset("tiny")).parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False, use_fused=False) == (False, False)
    seconds = adamw_step_seconds(preset("tiny"), repeats=3)
    assert set(seconds) == {"default", "fused"} and all(s > 0 for s in seconds.values())


def test_every_recorded_cpu_flag_has_its_meaning_on_the_page():
    assert set(ISA_MEANING) == set(ISA_FLAGS)


def test_memory_figure_stacks_the_four_parts_end_to_end():
    state = {"params": 4e6, "grads": 4e6, "optimizer": 8e6}
    fig = memory_figure(state, activations=20e6, batch=16, title="t")
    bars = fig.axes[0].patches
    assert [b.get_width() for b in bars] == [4.0, 4.0, 8.0, 20.0]  # MB
    assert all(math.isclose(b.get_x(), sum(w.get_width() for w in bars[:i])) for i, b in enumerate(bars))
    assert sum(b.get_width() for b in bars) == (16e6 + 20e6) / MB
    plt.close(fig)
