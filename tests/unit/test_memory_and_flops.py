import math
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distlab import flops
from distlab.flops import flops_per_token, matmul_parameters, measured_peak_flops
from distlab.infra.launch import run_ranks
from distlab.memory import (
    activation_bytes_formula,
    adamw_state_bytes_formula,
    saved_activation_bytes,
    state_bytes,
)
from distlab.model import GPT, count_parameters, preset
from distlab.runtime import tf32_enabled, use_tf32


@pytest.mark.parametrize("name,batch", [("tiny", 4), ("tiny", 7), ("shakespeare", 2)])
def test_activation_formula_matches_saved_tensors_to_the_byte(name, batch):
    cfg = preset(name)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size))
    measured = saved_activation_bytes(GPT(cfg), idx, targets)
    assert measured == activation_bytes_formula(cfg, batch, cfg.block_size)["total"]


@pytest.mark.parametrize("name,batch", [("tiny", 4), ("tiny", 7)])
def test_activation_formula_with_bf16_parameters_matches_saved_tensors_to_the_byte(
    name, batch
):
    """FSDP2's param_dtype=bf16: every activation bf16 except attention's log-sum-exp
    and the log-softmax of logits.float(), which stay fp32."""
    cfg = preset(name)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size))
    measured = saved_activation_bytes(GPT(cfg).to(torch.bfloat16), idx, targets)
    assert (
        measured
        == activation_bytes_formula(cfg, batch, cfg.block_size, value_bytes=2)["total"]
    )
    with pytest.raises(ValueError, match="value_bytes is 4 .fp32. or 2 .bf16."):
        activation_bytes_formula(cfg, batch, cfg.block_size, value_bytes=1)


def test_bf16_autocast_saves_fewer_activation_bytes():
    cfg = preset("tiny")
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 4, cfg.block_size))
    model = GPT(cfg)
    fp32 = saved_activation_bytes(model, idx, targets)
    bf16 = saved_activation_bytes(
        model, idx, targets, autocast=torch.autocast("cpu", dtype=torch.bfloat16)
    )
    assert 0.4 * fp32 < bf16 < fp32


def test_adamw_state_is_16_bytes_per_parameter_plus_step_counters():
    model = GPT(preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 65, (2, 16))
    model(idx, idx)[1].backward()
    optimizer.step()
    n_tensors = len(list(model.parameters()))
    assert state_bytes(model, optimizer) == adamw_state_bytes_formula(
        count_parameters(model), n_tensors
    )


# gpt2's 86M at context 1024: too slow for CPU CI
@pytest.mark.parametrize("name", ["tiny", "shakespeare"])
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


def test_the_peak_is_timed_in_every_run_and_left_on_no_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DISTLAB_CACHE", str(tmp_path / "cache"))
    cpu = torch.device("cpu")
    # timed: how fast depends on the load
    assert 0 < measured_peak_flops(cpu, torch.float32) < math.inf
    # no cache: a peak from another moment is not this run's
    assert list(tmp_path.iterdir()) == []


def _peak_timed_together(threads: int) -> dict:
    torch.set_num_threads(threads)
    start = time.time()
    peak = measured_peak_flops(torch.device("cpu"), torch.float32)
    return {
        "peak": peak,
        "start": start,
        "end": time.time(),
        "u": utilisation(0.5 * peak, torch.device("cpu")),
    }


def test_ranks_time_the_peak_at_the_same_moment_and_agree_on_it():
    ranks = run_ranks(_peak_timed_together, nprocs=2, args=(1,))
    # the mean of the ranks' best, on every rank
    assert ranks[0]["peak"] == ranks[1]["peak"] > 0
    # their timings overlapped: no rank can leave before every rank has joined the
    # all-reduces inside, however loaded the machine (an order the collective sets, not
    # a duration)
    assert max(r["start"] for r in ranks) < min(r["end"] for r in ranks)
    for r in ranks:
        assert r["u"]["peak_measured_with"] == {
            "threads_per_rank": 1,
            "ranks_at_once": 2,
            # oneDNN's: a CPU's matmuls
            "float32_matmul_precision": torch.backends.mkldnn.matmul.fp32_precision,
            "tf32": None,  # a GPU's setting
        }
        # the MFU is the achieved rate over the peak that utilisation timed again (None
        # above 1: no peak)
        ratio = 0.5 * r["peak"] / r["u"]["peak_flops_per_s"]
        assert r["u"]["mfu"] == (pytest.approx(ratio) if ratio <= 1 else None)
        assert r["u"]["datasheet_peak"] is None  # a CPU has no datasheet row


def utilisation(achieved: float, device: torch.device) -> dict:
    return flops.utilisation(achieved, device, torch.float32)


def test_an_mfu_above_one_is_reported_loudly_and_not_recorded(monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"MFU 1.20 > 1 .* not a peak"):
        assert flops.mfu_or_none(120e9, 100e9, "measured matmul peak") is None
    assert flops.mfu_or_none(50e9, 100e9, "measured matmul peak") == 0.5
    # a "peak" timed under load
    monkeypatch.setattr(flops, "measured_peak_flops", lambda device, dtype: 1e9)
    with pytest.warns(RuntimeWarning, match="MFU not recorded"):
        u = utilisation(2e9, torch.device("cpu"))
    assert u["mfu"] is None and u["peak_flops_per_s"] == 1e9
    assert "MFU not recorded" in flops.describe_mfu(u)


@pytest.mark.parametrize(
    "name,dtype,tf32,expected",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, ("H100 SXM bf16", 989.5e12)),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, ("H100 PCIe bf16", 756.5e12)),
        ("NVIDIA H200", torch.float32, False, ("H200 SXM fp32", 67e12)),
        ("NVIDIA H200 NVL", torch.float32, True, ("H200 NVL tf32", 417.5e12)),
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, ("A100 tf32", 156e12)),
        ("NVIDIA L40S", torch.bfloat16, False, ("L40S bf16", 362.05e12)),
        ("NVIDIA L40S", torch.float32, True, ("L40S tf32", 183e12)),
        ("NVIDIA L4", torch.bfloat16, False, ("L4 bf16", 121e12)),
        ("NVIDIA L4", torch.float32, False, ("L4 fp32", 30.3e12)),
        ("NVIDIA L4", torch.float32, True, ("L4 tf32", 60e12)),
        ("NVIDIA A10", torch.bfloat16, False, ("A10 bf16", 125e12)),
        ("NVIDIA A10", torch.float32, True, ("A10 tf32", 62.5e12)),
        # not in the table: no datasheet MFU
        ("NVIDIA GH200 480GB", torch.bfloat16, False, None),
        # AWS's A10 variant: another chip, no datasheet row
        ("NVIDIA A10G", torch.bfloat16, False, None),
        # the L40 is not the L40S, nor an L4
        ("NVIDIA L40", torch.bfloat16, False, None),
    ],
)
def test_the_datasheet_peak_is_read_by_gpu_name_and_precision(
    monkeypatch, name, dtype, tf32, expected
):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    before = tf32_enabled()  # a computed setting: monkeypatch cannot restore it
    use_tf32(tf32)
    try:
        assert flops.datasheet_peak(torch.device("cuda", 0), dtype) == expected
        assert flops.datasheet_peak(torch.device("cpu"), dtype) is None
    finally:
        use_tf32(before)


def test_a_gpu_run_gets_the_mfu_of_both_peaks_and_records_its_matmul_precision(
    monkeypatch,
):
    """On an H100 (its name and a timed peak stood in for): MFU of the measured matmul
    peak and of the datasheet's, and the fp32 matmul setting the peak was timed under.
    """
    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3"
    )
    # a matmul, timed
    monkeypatch.setattr(flops, "measured_peak_flops", lambda device, dtype: 700e12)
    before = tf32_enabled()
    try:
        for tf32, sheet in ((False, 67e12), (True, 494.5e12)):
            use_tf32(tf32)
            u = flops.utilisation(35e12, torch.device("cuda", 0), torch.float32)
            assert (
                u["mfu"] == pytest.approx(35 / 700) and u["peak_flops_per_s"] == 700e12
            )
            assert u["datasheet_peak"] == {
                "of": f"H100 SXM {'tf32' if tf32 else 'fp32'}",
                "flops_per_s": sheet,
            }
            assert u["mfu_of_datasheet_peak"] == pytest.approx(35e12 / sheet)
            assert u["peak_measured_with"] == {
                # a GPU's peak does not depend on the host's threads
                "threads_per_rank": None,
                "ranks_at_once": 1,
                # ieee: true fp32, as use_tf32(False) sets
                "float32_matmul_precision": "tf32" if tf32 else "ieee",
                "tf32": tf32,
            }
            assert f"{35e12 / sheet:.2f} of the H100 SXM" in flops.describe_mfu(u)
    finally:
        use_tf32(before)


def test_the_cpu_flags_agree_with_the_vector_isa_torch_uses():
    isa = flops.cpu_isa_flags()
    assert set(isa) == set(flops.ISA_FLAGS)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        assert isa["avx512f"]
    if capability.startswith("AVX2") or capability.startswith("AVX512"):
        assert isa["avx2"] and isa["fma"]
