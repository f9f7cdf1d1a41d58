"""FLOPs per token, a measured peak, and MFU: throughput numbers that can be trusted.

MFU (model FLOPs utilisation) = FLOPs the model needs per second / peak FLOP/s of the
device. Both halves are ours: the numerator from the formula below, the denominator
from a large matmul timed on the very device and dtype the run uses (never a datasheet
number, which CPUs in particular do not reach).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from distlab.model import GPTConfig

FLOPS_FORMULA = "6 * (12*L*C^2 + V*C) + 12*L*C*T per token (6N for matmul weights, plus attention)"


def matmul_parameters(cfg: GPTConfig) -> int:
    """Weights that multiply activations: 12 C^2 per block plus the (tied) LM head."""
    return cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: 6N for the weights plus 12*L*C*T for attention.

    Each weight does one multiply-add (2 FLOPs) per token forward and two backward (the
    gradient with respect to input and weight): 6N. Attention scores QK^T and the
    weighted sum AV cost 2*T*C each per token per layer forward, 3x that with backward:
    12*L*C*T. Embedding lookups, LayerNorm, GELU and softmax are left out (small), and
    the causal mask's skipped half is counted, as in the PaLM paper's appendix B.
    """
    T = seq_len or cfg.block_size
    return 6 * matmul_parameters(cfg) + 12 * cfg.n_layer * cfg.n_embd * T


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


def _time_matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(repeats + 1):  # the first call warms caches and the allocator
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cache_dir() -> Path:
    """Where the measured peaks are kept between runs: ``$DISTLAB_CACHE``, else ``~/.cache/distlab``."""
    return Path(os.environ.get("DISTLAB_CACHE", Path.home() / ".cache" / "distlab"))


def measured_peak_flops(device: torch.device, dtype: torch.dtype, refresh: bool = False) -> float:
    """Best FLOP/s of a large square matmul on ``device`` in ``dtype``, cached on disk.

    The cache key holds the device model, dtype, thread count and torch version: the
    same CPU with 1 thread per rank has half the peak of 2 threads.
    """
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    key = f"{device_name(device)}|{dtype}|threads={threads}|torch={torch.__version__}"
    path = cache_dir() / "peak_flops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache and not refresh:
        return cache[key]
    # start small: on a CPU without native bf16 a 2048^3 bf16 matmul takes ten seconds
    n, repeats = (8192, 20) if device.type == "cuda" else (2048, 5)
    probe = _time_matmul(device, dtype, 512, 1)
    if 2 * n**3 / probe > 2.0:  # seconds per call at the probe's rate
        n, repeats = 1024, 1  # a slow path: small matmuls under-state even its peak
    peak = max(probe, _time_matmul(device, dtype, n, repeats))
    cache[key] = peak
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)  # ranks measuring at once must not leave a torn file
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return peak
