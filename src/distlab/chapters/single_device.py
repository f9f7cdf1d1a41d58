"""The single-device baseline chapter's experiments: parameters counted two ways, model
state and activations measured against their formulas, the attention kernel PyTorch
picked, fused against the default AdamW, FLOPs counted by PyTorch against ours, this
machine's matmul peaks and instruction sets, and lab 1's tokens/s and MFU as the book's
benchmark recorded them.

    parameter_table()  # formula == PyTorch's count, per preset
    model_state_after_one_step(preset("tiny"))
    activation_table(batch=16)  # saved-for-backward bytes: formula, fp32, bf16
    attention_kernel(preset("tiny"), torch.float32)  # the SDPA kernel autograd recorded
    adamw_step_seconds(preset("tiny"))  # one optimizer step: the default and fused
    counted_flops_per_token(preset("tiny"), math_attention=True)
    recorded_lab1()  # lab 1's recorded run per dtype, with its provenance

Everything runs in one process. Lab 1's runs at batch 16 take minutes of CPU, too long
for every build: ``python -m distlab.bench`` records them (``RECORDED_LAB1``), and the
page reads them.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import torch

from distlab.flops import measured_peak_flops
from distlab.infra.paths import RESULTS_DIR
from distlab.memory import (
    activation_bytes_formula,
    adamw_state_bytes_formula,
    saved_activation_bytes,
    state_bytes,
)
from distlab.model import (
    GPT,
    PRESETS,
    GPTConfig,
    count_parameters,
    parameter_formula,
    preset,
)
from distlab.runtime import DTYPES

MB = 1e6
# lab 1 on the shakespeare preset at batch 16, 6 steps, 3 repeats (the median run kept),
# per dtype, as python -m distlab.bench recorded it: fp32 in the benchmark of every lab
# (the Benchmarks chapter's), bf16 by
#   python -m distlab.bench --labs 1 --ranks 1 --preset shakespeare --batch-size 16 \
#       --steps 6 --repeats 3 --dtype bf16
RECORDED_LAB1 = {
    dtype: RESULTS_DIR / "bench" / f"cpu_shakespeare_{dtype}.json"
    for dtype in ("fp32", "bf16")
}


def parameter_table() -> list[dict]:
    """Each preset's size, with ``parameter_formula`` next to PyTorch's count of a real
    model (built on the meta device: the same modules and parameter shapes, no memory
    and no initialisation)."""
    rows = []
    for name in PRESETS:
        cfg = preset(name)
        with torch.device("meta"):
            model = GPT(cfg)
        rows.append(
            {
                "preset": name,
                "L": cfg.n_layer,
                "C": cfg.n_embd,
                "T": cfg.block_size,
                "formula": parameter_formula(cfg),
                "counted": count_parameters(model),
            }
        )
    return rows


def model_state_after_one_step(
    cfg: GPTConfig, seed: int = 0
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of parameters, gradients and AdamW state counted from the tensors after one
    real step (AdamW creates its state lazily, on the first step), and what the
    formula says."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
    _, loss = model(idx, idx)
    loss.backward()
    optimizer.step()
    n_tensors = len(list(model.parameters()))
    return state_bytes(model, optimizer), adamw_state_bytes_formula(
        count_parameters(model), n_tensors
    )


def activation_table(
    batch: int = 16, presets: tuple[str, ...] = ("tiny", "shakespeare")
) -> list[dict]:
    """Bytes saved for backward at full context, counted with a ``saved_tensors_hooks``
    pack hook in fp32 and under bf16 autocast, next to ``activation_bytes_formula``
    (fp32). The CPU presets by default: the gpt2 preset's forward pass at batch 16 and
    context 1024 is a GPU's work."""
    rows = []
    for name in presets:
        cfg = preset(name)
        model = GPT(cfg)
        # inputs, targets
        x, y = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size))
        rows.append(
            {
                "preset": name,
                "formula": activation_bytes_formula(cfg, batch, cfg.block_size)[
                    "total"
                ],
                "fp32": saved_activation_bytes(model, x, y),
                "bf16": saved_activation_bytes(
                    model, x, y, autocast=torch.autocast("cpu", dtype=torch.bfloat16)
                ),
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
    for (label, value), color in zip(
        parts.items(), ["#3b6ea5", "#6c9bd2", "#a9c6ea", "#e39b4c"]
    ):
        ax.barh(
            0, value / MB, left=left, color=color, label=f"{label}: {value / MB:.0f} MB"
        )
        left += value / MB
    ax.set_yticks([])
    ax.set_xlabel("MB")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def attention_kernel(cfg: GPTConfig, dtype: torch.dtype, batch: int = 2) -> str:
    """The kernel ``scaled_dot_product_attention`` ran for this model's attention
    shapes, named by the backward node autograd recorded for it (one node type
    per kernel)."""
    q, k, v = torch.randn(
        3, batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head, dtype=dtype
    )
    q.requires_grad_()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return type(out.grad_fn).__name__


def adamw_step_seconds(cfg: GPTConfig, repeats: int = 5) -> dict[str, float]:
    """Median seconds of one AdamW step over the model's parameters, with PyTorch's
    default implementation (on a CPU a loop over the tensors:
    ``torch/utils/_foreach_utils.py`` lists no CPU among the foreach devices) and with
    ``fused=True``, timed in turns (A B A B ...) so that load hits both alike."""
    model = GPT(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers = {
        "default": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "fused": torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
    }
    for opt in optimizers.values():
        opt.step()  # the first step allocates the moments
    times: dict[str, list[float]] = {kind: [] for kind in optimizers}
    for _ in range(repeats):
        for kind, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[kind].append(time.perf_counter() - start)
    return {kind: statistics.median(t) for kind, t in times.items()}


# what each instruction-set flag of /proc/cpuinfo (distlab.flops.ISA_FLAGS) means for
# a matmul
ISA_MEANING = {
    "avx2": "256-bit vectors",
    "fma": "fused multiply-add: a multiply and an add in one instruction",
    "avx512f": "512-bit vectors: twice AVX2's fp32 multiply-adds per instruction",
    "avx512_vnni": "int8/int16 dot products (quantised inference)",
    "avx512_bf16": (
        "bf16 dot products accumulated in fp32: twice the fp32 multiply-adds per "
        "instruction"
    ),
    "avx512_fp16": "fp16 arithmetic on 512-bit vectors",
    "amx_tile": "AMX tile registers (Intel Sapphire Rapids and later)",
    "amx_bf16": "AMX bf16 tile matrix multiply: far beyond the vector units",
}


def counted_flops_per_token(cfg: GPTConfig, math_attention: bool) -> float:
    """FLOPs of one training step (forward and backward) per token, as PyTorch's
    ``FlopCounterMode`` counts them. It has no formula for the fused CPU attention
    kernel, so attention is counted only when it runs on the math backend (plain
    batched matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    attention = (
        sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
    )
    with attention, FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    return counter.get_total_flops() / x.numel()


def measure_peaks(
    device: torch.device, dtypes: tuple[str, ...] = ("fp32", "bf16")
) -> dict[str, float]:
    """This machine's matmul peak FLOP/s per dtype, timed now in this process."""
    return {dtype: measured_peak_flops(device, DTYPES[dtype]) for dtype in dtypes}


def recorded_lab1(dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict[str, dict]:
    """Lab 1's recorded run (1 process) per dtype that has a recording: its summary
    figures (tokens/s, achieved FLOP/s, the peak its run timed at its end, MFU, losses,
    config), with the recording's ``provenance`` (machine, CPU flags, load, torch,
    commit, date, command) added."""
    results = {}
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(
                f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}"
            )
        path = RECORDED_LAB1.get(dtype)
        if path is None or not path.is_file():
            continue
        recorded = json.loads(path.read_text())
        run = next(
            r
            for r in recorded["runs"]
            if r["lab"] == "lab1_single" and r["world_size"] == 1
        )
        results[dtype] = {
            **run,
            "provenance": recorded["provenance"],
            "file": path.relative_to(RESULTS_DIR.parent).as_posix(),
        }
    return results


def mfu_figure(results: dict[str, dict], title: str):
    """MFU of each run as a bar, labelled with its tokens/s."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    names = list(results)
    # None: above 1, not recorded (the peak was no peak)
    mfu = {d: results[d]["mfu"] for d in names}
    bars = ax.barh(
        names,
        [mfu[d] or 0.0 for d in names],
        color=["#3b6ea5", "#e39b4c"][: len(names)],
    )
    for bar, d in zip(bars, names):
        shown = "not recorded" if mfu[d] is None else f"{mfu[d]:.2f}"
        label = f"MFU {shown}, {results[d]['tokens_per_s']:,.0f} tokens/s"
        ax.text(
            bar.get_width() + 0.01,
            bar.get_y() + bar.get_height() / 2,
            label,
            va="center",
        )
    ax.set_xlim(0, 1.3)
    ax.set_xlabel("MFU: fraction of the measured matmul peak")
    ax.set_title(title)
    fig.tight_layout()
    return fig
