"""The single-device baseline chapter's experiments: parameters counted two ways, model state
and activations measured against their formulas, FLOPs counted by PyTorch against ours, this
machine's matmul peaks, and lab 1's tokens/s and MFU.

    parameter_table()                        # formula == PyTorch's count, per preset
    model_state_after_one_step(preset("tiny"))
    activation_table(batch=16)               # saved-for-backward bytes: formula, fp32, bf16
    counted_flops_per_token(preset("tiny"), math_attention=True)
    run_lab1(["fp32"], out_dir)              # lab 1's summary.json, per dtype

Everything runs in one process; ``run_lab1`` launches the lab script as the book's labs run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from distlab.flops import measured_peak_flops
from distlab.infra.launch import run_script
from distlab.memory import activation_bytes_formula, adamw_state_bytes_formula, saved_activation_bytes, state_bytes
from distlab.metrics import read_summary
from distlab.model import GPT, PRESETS, GPTConfig, count_parameters, parameter_formula, preset
from distlab.runtime import DTYPES

MB = 1e6
LAB1 = "src/labs/lab1_single.py"


def parameter_table() -> list[dict]:
    """Each preset's size, with ``parameter_formula`` next to PyTorch's count of a real model."""
    rows = []
    for name in PRESETS:
        cfg = preset(name)
        rows.append(
            {
                "preset": name,
                "L": cfg.n_layer,
                "C": cfg.n_embd,
                "T": cfg.block_size,
                "formula": parameter_formula(cfg),
                "counted": count_parameters(GPT(cfg)),
            }
        )
    return rows


def model_state_after_one_step(cfg: GPTConfig, seed: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of parameters, gradients and AdamW state counted from the tensors after one real
    step (AdamW creates its state lazily, on the first step), and what the formula says."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    n_tensors = len(list(model.parameters()))
    return state_bytes(model, optimizer), adamw_state_bytes_formula(count_parameters(model), n_tensors)


def activation_table(batch: int = 16, presets: tuple[str, ...] = tuple(PRESETS)) -> list[dict]:
    """Bytes saved for backward at full context, counted with a ``saved_tensors_hooks`` pack hook
    in fp32 and under bf16 autocast, next to ``activation_bytes_formula`` (fp32)."""
    rows = []
    for name in presets:
        cfg = preset(name)
        model = GPT(cfg)
        x, y = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size))  # inputs, targets
        rows.append(
            {
                "preset": name,
                "formula": activation_bytes_formula(cfg, batch, cfg.block_size)["total"],
                "fp32": saved_activation_bytes(model, x, y),
                "bf16": saved_activation_bytes(model, x, y, autocast=torch.autocast("cpu", dtype=torch.bfloat16)),
            }
        )
    return rows


def memory_figure(state: dict[str, int], activations: int, batch: int, title: str):
    """One horizontal bar: parameters, gradients, AdamW state and activations, in MB."""
    import matplotlib.pyplot as plt

    parts = {
        "parameters": state["params"],
        "gradients": state["grads"],
        "AdamW state": state["optimizer"],
        f"activations (batch {batch})": activations,
    }
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for (label, value), color in zip(parts.items(), ["#3b6ea5", "#6c9bd2", "#a9c6ea", "#e39b4c"]):
        ax.barh(0, value / MB, left=left, color=color, label=f"{label}: {value / MB:.0f} MB")
        left += value / MB
    ax.set_yticks([])
    ax.set_xlabel("MB")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def counted_flops_per_token(cfg: GPTConfig, math_attention: bool) -> float:
    """FLOPs of one training step (forward and backward) per token, as PyTorch's
    ``FlopCounterMode`` counts them. It has no formula for the fused CPU attention kernel, so
    attention is counted only when it runs on the math backend (plain batched matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    attention = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
    with attention, FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    return counter.get_total_flops() / x.numel()


def measure_peaks(device: torch.device, dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict[str, float]:
    """This machine's matmul peak FLOP/s per dtype (measured once, then cached)."""
    return {dtype: measured_peak_flops(device, DTYPES[dtype]) for dtype in dtypes}


def run_lab1(
    dtypes: list[str], out_dir: str | Path, preset_name: str = "shakespeare", batch: int = 16, steps: int = 6
) -> dict[str, dict]:
    """Lab 1 for a few steps in each dtype (the steps after the first two are timed); its
    ``summary.json`` per dtype: tokens/s, achieved FLOP/s, the peak it was divided by, MFU."""
    if steps < 3:
        raise ValueError(f"steps must be at least 3 (the first two are not timed), got {steps}")
    results = {}
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        out = Path(out_dir) / dtype
        args = ["--preset", preset_name, "--batch-size", str(batch), "--steps", str(steps), "--dtype", dtype]
        args += ["--eval-batches", "1", "--sample-chars", "0", "--no-progress", "--out", str(out)]
        run_script(LAB1, args, quiet=True)
        results[dtype] = read_summary(out)
    return results


def mfu_figure(results: dict[str, dict], title: str):
    """MFU of each run as a bar, labelled with its tokens/s."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    names = list(results)
    bars = ax.barh(names, [results[d]["mfu"] for d in names], color=["#3b6ea5", "#e39b4c"][: len(names)])
    for bar, d in zip(bars, names):
        label = f"MFU {results[d]['mfu']:.2f}, {results[d]['tokens_per_s']:,.0f} tokens/s"
        ax.text(bar.get_width() + 0.01, bar.get_y() + bar.get_height() / 2, label, va="center")
    ax.set_xlim(0, 1.3)
    ax.set_xlabel("fraction of this machine's measured matmul peak")
    ax.set_title(title)
    fig.tight_layout()
    return fig
