import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distlab.flops import flops_per_token, matmul_parameters, measured_peak_flops
from distlab.memory import activation_bytes_formula, adamw_state_bytes_formula, saved_activation_bytes, state_bytes
from distlab.model import GPT, PRESETS, count_parameters, preset


@pytest.mark.parametrize("name,batch", [("tiny", 4), ("tiny", 7), ("shakespeare", 2)])
def test_activation_formula_matches_saved_tensors_to_the_byte(name, batch):
    cfg = preset(name)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size))
    measured = saved_activation_bytes(GPT(cfg), idx, targets)
    assert measured == activation_bytes_formula(cfg, batch, cfg.block_size)["total"]


def test_bf16_autocast_saves_fewer_activation_bytes():
    cfg = preset("tiny")
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 4, cfg.block_size))
    model = GPT(cfg)
    fp32 = saved_activation_bytes(model, idx, targets)
    bf16 = saved_activation_bytes(model, idx, targets, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    assert 0.4 * fp32 < bf16 < fp32


def test_adamw_state_is_16_bytes_per_parameter_plus_step_counters():
    model = GPT(preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 65, (2, 16))
    model(idx, idx)[1].backward()
    optimizer.step()
    n_tensors = len(list(model.parameters()))
    assert state_bytes(model, optimizer) == adamw_state_bytes_formula(count_parameters(model), n_tensors)


@pytest.mark.parametrize("name", list(PRESETS))
def test_flops_formula_agrees_with_pytorchs_flop_counter(name):
    """6N + 12LCT against FlopCounterMode's count of every matmul.

    The counter cannot see inside the fused CPU attention kernel, so attention runs on
    the math backend here, as plain batched matmuls that it does count."""
    cfg = preset(name)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    counted = counter.get_total_flops() / idx.numel()
    assert counted == flops_per_token(cfg)


def test_matmul_parameters_leave_out_position_embeddings_and_small_vectors():
    cfg = preset("shakespeare")
    assert matmul_parameters(cfg) == 6 * 12 * 384**2 + 65 * 384


def test_peak_flops_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    first = measured_peak_flops(cpu, torch.float32)
    assert first > 1e9  # any CPU of this century does a GFLOP/s
    assert (tmp_path / "peak_flops.json").exists()
    assert measured_peak_flops(cpu, torch.float32) == first  # served from the cache
