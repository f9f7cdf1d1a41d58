"""FLOPs per token, the measured matmul peak, and MFU: throughput numbers that can
be trusted.

MFU (model FLOPs utilisation) = FLOPs the model needs per second / peak FLOP/s of the
device. The numerator comes from the formula below. The denominator is measured: a large
matmul timed in the run's own process, on its device and dtype, with its threads, at the
end of the run, by every rank of the run at the same moment (ranks on one machine share
its cores and memory bandwidth, so a peak timed by one rank alone is not what each of
them can reach). MFU here is therefore "of the measured matmul peak". On a GPU whose
datasheet is in ``DATASHEET_PEAKS``, ``utilisation`` gives MFU against the datasheet's
dense peak too, the number most reports divide by; CPUs have no such figure here.

The float32 matmul precision decides what an fp32 matmul can reach on a GPU: an H100's
datasheet gives 67 TFLOP/s for true fp32 and 494.5 when TF32 is allowed (the labs'
``--tf32``). There is no cache of peaks to key by it: every run times its own peak under
its own setting and records that setting with the peak (``peak_measured_with``), so no
peak is ever read under a precision it was not timed with.

An MFU above 1 is not a fast run; one of three things happened. The numerator credits
the whole causal attention product, which a fused kernel computes about half of (the
larger the context, the more this overstates). A model matmul of another shape can run
faster than the one square matmul that set the "peak". Or the machine was busier while
the peak was timed than during the run. ``utilisation`` says so with a warning and
records no MFU rather than a wrong one.
"""

from __future__ import annotations

import math
import platform
import re
import time
import warnings

import torch
import torch.distributed as dist

from distlab.costs.flops import training_flops_per_token
from distlab.model import GPTConfig
from distlab.runtime import tf32_enabled

FLOPS_FORMULA = (
    "6 * (12*L*C^2 + V*C) + 12*L*C*T per token (6N for matmul weights, plus attention)"
)

# Dense peak FLOP/s (no 2:4 sparsity: NVIDIA's "*" figures are twice these) from
# NVIDIA's datasheets: "NVIDIA A100 Tensor Core GPU" (SXM and PCIe alike), "NVIDIA H100
# Tensor Core GPU" (SXM, PCIe, NVL) and "NVIDIA H200 Tensor Core GPU" (SXM, NVL);
# www.nvidia.com/en-us/data-center/. L4-class (PCIe cards): "NVIDIA L40S" datasheet
# (FP32 91.6; TF32 183, 366*; BF16 362.05, 733*), "NVIDIA L4 Tensor Core GPU" datasheet
# (FP32 30.3; TF32 120*; BF16 242*, halved here) and "NVIDIA A10 Tensor Core GPU"
# datasheet (FP32 31.2; TF32 62.5, 125*; BF16 125, 250*). The A10G (AWS's variant) is
# another chip with other figures: it has no row. The pattern is searched in
# torch.cuda.get_device_name(); the first match wins. fp32 is the CUDA cores' rate; tf32
# is what an fp32 matmul gets when TF32 is allowed.
DATASHEET_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (r"\bA100\b", "A100", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12}),
    (r"\bH100 NVL\b", "H100 NVL", {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12}),
    (r"\bH100 PCIe\b", "H100 PCIe", {"fp32": 51e12, "tf32": 378e12, "bf16": 756.5e12}),
    (r"\bH100\b", "H100 SXM", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12}),
    (r"\bH200 NVL\b", "H200 NVL", {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12}),
    (r"\bH200\b", "H200 SXM", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12}),
    (r"\bL40S\b", "L40S", {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12}),
    (r"\bL4\b", "L4", {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12}),
    (r"\bA10\b", "A10", {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12}),
]


def matmul_parameters(cfg: GPTConfig) -> int:
    """Weights that multiply activations: 12 C^2 per block plus the (tied) LM head."""
    return cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: 6N for the weights plus 12*L*C*T for attention
    (``distlab.costs.flops``). Embedding lookups, LayerNorm, GELU and softmax are left
    out (small)."""
    T = seq_len or cfg.block_size
    return training_flops_per_token(matmul_parameters(cfg), cfg.n_layer, cfg.n_embd, T)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the CPU instruction sets that decide how fast a bf16 (and an fp32) matmul can be
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)


def cpu_isa_flags() -> dict[str, bool]:
    """Which of ``ISA_FLAGS`` this CPU has, read from /proc/cpuinfo (empty where there
    is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (
                    line.split(":", 1)[1].split()
                    for line in f
                    if line.startswith("flags")
                ),
                None,
            )
    except OSError:
        flags = None
    return {} if flags is None else {name: name in flags for name in ISA_FLAGS}


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    """``value`` reduced over the ranks (itself outside a process group). A collective:
    it also makes every rank wait for the others, which lines their matmuls up in time.
    """
    if not _in_group():
        return value
    # NCCL reduces device tensors only
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def _matmul_flops_per_s(
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    min_calls: int,
    max_calls: int,
    budget_s: float,
) -> float:
    """Best FLOP/s of an n x n matmul: one warm-up call, then at least ``min_calls``
    timed ones, more while ``budget_s`` seconds last (at most ``max_calls``). Every rank
    makes the same calls at the same moments: each starts after a collective, and the
    ranks agree when to stop."""
    # its own generator: the run's random state stays as it was
    g = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=g).to(dtype) for _ in range(2))
    best, spent, calls = math.inf, 0.0, -1  # call -1 warms caches and the allocator
    while True:
        go_on = calls < min_calls or (calls < max_calls and spent < budget_s)
        # one rank done: all done
        if _all_reduce(float(go_on), dist.ReduceOp.MIN, device) == 0.0:
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        if calls >= 0:
            best, spent = min(best, seconds), spent + seconds
        calls += 1
    return 2 * n**3 / best


def measured_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul on ``device`` in ``dtype``, timed now, in
    this process.

    It runs with the threads the process has. In a process group every rank times it at
    the same moment and all of them get the mean of the ranks' best: the peak of one
    rank when all ranks compute, which is the situation of the run. Not cached: a peak
    timed while the machine was idle is not the peak of a run made while it was busy,
    nor the other way round.
    """
    # start small: on a CPU without native bf16 a 2048^3 bf16 matmul takes ten seconds.
    # On a CPU the best of 2 timed calls spreads as the best of 4 did (six tries each,
    # one thread: 92-96 against 90-97 GFLOP/s) for 0.6 CPU-seconds instead of 1.0, paid
    # by every rank of every run
    n, min_calls, max_calls, budget = (
        (8192, 5, 50, 0.5) if device.type == "cuda" else (2048, 2, 10, 0.3)
    )
    probe = _matmul_flops_per_s(device, dtype, 512, 1, 1, 0.0)
    # every rank must choose the same size
    probe = _all_reduce(probe, dist.ReduceOp.MIN, device)
    if 2 * n**3 / probe > 2.0:  # seconds per call at the probe's rate
        n, min_calls = 1024, 1  # a slow path: small matmuls under-state even its peak
    best = max(
        probe, _matmul_flops_per_s(device, dtype, n, min_calls, max_calls, budget)
    )
    world = dist.get_world_size() if _in_group() else 1
    return _all_reduce(best, dist.ReduceOp.SUM, device) / world


def fp32_matmul_precision(device: torch.device) -> str:
    """The float32 matmul precision set for ``device``'s matmuls (cuBLAS on CUDA, oneDNN
    on a CPU).

    The per-backend view of torch 2.13: ``torch.get_float32_matmul_precision()``, the
    legacy one, raises once a program has mixed the legacy and the new setters (see
    ``runtime.use_tf32``)."""
    backend = torch.backends.cuda if device.type == "cuda" else torch.backends.mkldnn
    return backend.matmul.fp32_precision


def datasheet_peak(
    device: torch.device, dtype: torch.dtype
) -> tuple[str, float] | None:
    """(GPU and precision, dense peak FLOP/s) from ``DATASHEET_PEAKS``; None for a CPU
    or a GPU not in the table. An fp32 matmul counts at the TF32 rate when TF32
    is allowed."""
    if device.type != "cuda":
        return None
    precision = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype)
    if precision == "fp32" and tf32_enabled():
        precision = "tf32"
    entry = datasheet_entry(torch.cuda.get_device_name(device))
    if entry is None or precision not in entry[1]:
        return None
    return f"{entry[0]} {precision}", entry[1][precision]


def datasheet_entry(gpu_name: str) -> tuple[str, dict[str, float]] | None:
    """The ``DATASHEET_PEAKS`` row of a GPU by the name CUDA reports ("NVIDIA H100 80GB
    HBM3"): its datasheet name and its dense peaks by precision; None if not listed."""
    for pattern, gpu, peaks in DATASHEET_PEAKS:
        if re.search(pattern, gpu_name):
            return gpu, peaks
    return None


def mfu_or_none(
    achieved_flops_per_s: float, peak_flops_per_s: float, of_what: str
) -> float | None:
    """achieved / peak; above 1 the "peak" was not one: a warning, and None instead of
    the ratio."""
    ratio = achieved_flops_per_s / peak_flops_per_s
    if ratio > 1:
        warnings.warn(
            f"MFU {ratio:.2f} > 1 against the {of_what} "
            f"({peak_flops_per_s / 1e9:,.0f} GFLOP/s): not a peak for this run "
            "(the formula credits attention's masked half, a model matmul beat the "
            "square probe, or the probe ran while the machine was busier); "
            "MFU not recorded",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return ratio


def utilisation(
    achieved_flops_per_s: float, device: torch.device, dtype: torch.dtype
) -> dict:
    """MFU of the run, for its summary: against the matmul peak measured now by every
    rank at once (``measured_peak_flops``) and, on a GPU in ``DATASHEET_PEAKS``, against
    its datasheet peak. Call it on every rank of the run at the same point (it times the
    peak together)."""
    peak = measured_peak_flops(device, dtype)
    sheet = datasheet_peak(device, dtype)
    return {
        "peak_flops_per_s": peak,
        "peak_measured_with": {
            "threads_per_rank": torch.get_num_threads()
            if device.type == "cpu"
            else None,
            "ranks_at_once": dist.get_world_size() if _in_group() else 1,
            # what an fp32 matmul was allowed to do while the peak was timed: this
            # device's matmul setting ("none", unset: true fp32; "tf32"; "bf16"), read
            # where torch 2.13 never raises
            "float32_matmul_precision": fp32_matmul_precision(device),
            # TF32 is a GPU's
            "tf32": tf32_enabled() if device.type == "cuda" else None,
        },
        "mfu": mfu_or_none(achieved_flops_per_s, peak, "measured matmul peak"),
        "datasheet_peak": None
        if sheet is None
        else {"of": sheet[0], "flops_per_s": sheet[1]},
        "mfu_of_datasheet_peak": None
        if sheet is None
        else mfu_or_none(achieved_flops_per_s, sheet[1], sheet[0]),
    }


def describe_mfu(u: dict) -> str:
    """One line for a run's last print: MFU of the measured matmul peak, and of the
    datasheet's."""
    peak = f"{u['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s"
    text = (
        f"MFU {u['mfu']:.2f} of the measured matmul peak ({peak})"
        if u["mfu"] is not None
        else f"MFU not recorded (above 1 against the measured matmul peak, {peak})"
    )
    if u["datasheet_peak"] is not None and u["mfu_of_datasheet_peak"] is not None:
        text += (
            f", {u['mfu_of_datasheet_peak']:.2f} of the {u['datasheet_peak']['of']} "
            "datasheet peak"
        )
    return text
