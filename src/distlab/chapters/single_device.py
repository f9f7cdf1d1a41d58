"""The single-device baseline chapter's experiments: parameters counted two ways, model
state and activations measured against their formulas, the attention kernel PyTorch
picked, what autocast does to the residual stream, the operators one AdamW step
dispatches (default against fused), FLOPs counted by PyTorch against ours and where they
go, and lab 1's tokens/s and MFU as the book's benchmark recorded them.

    parameter_table()  # formula == PyTorch's count, per preset
    model_state_after_one_step(preset("tiny"))
    activation_table(batch=16)  # saved-for-backward bytes: formula, fp32, bf16
    attention_kernel(preset("tiny"), torch.float32)  # the SDPA kernel autograd recorded
    autocast_dtypes()  # dtypes of a residual add and of LayerNorm under CPU autocast
    adamw_operator_counts(preset("tiny"))  # operators of one step: default and fused
    counted_flops_per_token(preset("tiny"), math_attention=True)
    flop_breakdown(preset("shakespeare"))  # training FLOPs per token, by part
    recorded_lab1()  # lab 1's recorded run per dtype, with its provenance

Everything runs in one process. Lab 1's runs at batch 16 take minutes of CPU, too long
for every build: ``python -m distlab.bench`` records them (``RECORDED_LAB1``), and the
page reads them.
"""

from __future__ import annotations

import collections
import contextlib
import json
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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
        # counting needs no initial values: skip drawing gpt2's 86M of them
        with torch.device("meta"), mock.patch.object(GPT, "init_weights"):
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


# the parts of a training step's FLOPs, in the order flop_breakdown returns them
FLOP_PARTS = ("MLP", "qkv", "out proj", "attention", "head")
_COLOURS = ["#3b6ea5", "#6c9bd2", "#a9c6ea", "#e39b4c", "#999999"]


def step_cost_figure(
    state: dict[str, int], activations: int, batch: int, flops: dict[str, float]
):
    """One training step, two bars: the bytes it holds (parameters, gradients, AdamW
    state, activations saved for backward) and its FLOPs per token by part."""
    import matplotlib.pyplot as plt

    memory = {
        "weights": state["params"],
        "grads": state["grads"],
        "AdamW": state["optimizer"],
        "activations": activations,
    }
    fig, (ax_m, ax_f) = plt.subplots(2, 1, figsize=(5.2, 4.8))
    for ax, parts, title, unit, colours in (
        # the model state in blues, the activations in orange
        (
            ax_m,
            memory,
            f"bytes held, batch {batch}",
            "MB",
            [*_COLOURS[:3], _COLOURS[3]],
        ),
        # the weight matmuls in blues, attention's own in orange
        (ax_f, flops, "FLOPs per token", "MFLOP", _COLOURS),
    ):
        left = 0.0
        for (label, value), colour in zip(parts.items(), colours):
            ax.barh(
                0,
                value / 1e6,
                left=left,
                color=colour,
                height=0.6,
                label=f"{label} {value / 1e6:,.{0 if value >= 1e7 else 1}f}",
            )
            left += value / 1e6
        ax.set_xlim(0, left)
        ax.set_yticks([])
        ax.set_title(f"{title}: {left:,.0f} {unit}", fontsize=13, loc="left")
        ax.legend(
            loc="upper center",
            bbox_to_anchor=(0.5, -0.2),
            ncol=2,
            frameon=False,
            fontsize=12,
            handlelength=1,
            columnspacing=1,
        )
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
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


class _OperatorCounter(TorchDispatchMode):
    """Counts every ATen operator dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not name.startswith("_record_function"):  # profiler marks, not work
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def adamw_operator_counts(cfg: GPTConfig) -> dict[str, collections.Counter]:
    """The ATen operators one AdamW step dispatches over the model's parameters, with
    PyTorch's default implementation (on a CPU a loop over the tensors:
    ``torch/utils/_foreach_utils.py`` lists no CPU among the foreach devices) and with
    ``fused=True``. Counted, not timed: the same on every machine."""
    model = GPT(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    counts = {}
    for kind, fused in (("default", None), ("fused", True)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        optimizer.step()  # the first step allocates the moments
        with _OperatorCounter() as counter:
            optimizer.step()
        counts[kind] = counter.counts
    return counts


def autocast_dtypes() -> dict[str, torch.dtype]:
    """Under CPU bf16 autocast: a Linear's output, the residual add of an fp32 stream
    and that output, LayerNorm of the fp32 sum, and LayerNorm of a bf16 tensor."""
    x, linear = torch.randn(2, 4, 8), torch.nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        branch = linear(x)
        residual = x + branch
        return {
            "linear": branch.dtype,
            "residual": residual.dtype,
            "layer_norm(residual)": F.layer_norm(residual, (8,)).dtype,
            "layer_norm(bf16)": F.layer_norm(residual.bfloat16(), (8,)).dtype,
        }


# what each instruction-set flag of /proc/cpuinfo (distlab.flops.ISA_FLAGS) means for
# a matmul
ISA_MEANING = {
    "avx2": "256-bit vectors",
    "fma": "a multiply and an add in one instruction",
    "avx512f": "512-bit vectors: twice AVX2's multiply-adds",
    "avx512_vnni": "int8/int16 dot products (quantised inference)",
    "avx512_bf16": "bf16 dot products into fp32: twice fp32's multiply-adds",
    "avx512_fp16": "fp16 arithmetic on 512-bit vectors",
    "amx_tile": "AMX tile registers (Intel Sapphire Rapids on)",
    "amx_bf16": "AMX bf16 tile multiplies: far beyond the vectors",
}


def _model_and_tokens(cfg: GPTConfig, device: str) -> tuple[GPT, torch.Tensor]:
    """The model and a (2, T) batch of token ids, on ``device``. On "meta" tensors have
    shapes and no data: FlopCounterMode counts from shapes, so the gpt2 preset costs
    nothing to count there, and its initial values are not drawn."""
    init = mock.patch.object(GPT, "init_weights") if device == "meta" else None
    with torch.device(device), init or contextlib.nullcontext():
        return GPT(cfg), torch.randint(0, cfg.vocab_size, (2, cfg.block_size))


def counted_flops_per_token(
    cfg: GPTConfig, math_attention: bool, device: str = "cpu"
) -> float:
    """FLOPs of one training step (forward and backward) per token, as PyTorch's
    ``FlopCounterMode`` counts them. It has no formula for the fused CPU attention
    kernel, so attention is counted only when it runs on the math backend (plain
    batched matmuls)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _model_and_tokens(cfg, device)
    attention = (
        sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
    )
    with attention, FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    return counter.get_total_flops() / x.numel()


def flop_breakdown(cfg: GPTConfig) -> dict[str, float]:
    """Training FLOPs per token by part (``FLOP_PARTS``), counted by ``FlopCounterMode``
    on the meta device with attention on the math backend.

    The counter attributes a forward pass's operators to the modules that ran them; in
    backward its attribution is loose, so each part is its forward count times 3 (the
    backward of a matmul is two matmuls of the same size). The page checks that the sum
    equals the counted training step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _model_and_tokens(cfg, "meta")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x)
    by_module = {
        name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()
    }

    def blocks(suffix: str) -> int:
        return sum(
            n
            for name, n in by_module.items()
            if name.endswith(suffix) and ".blocks." in name
        )

    qkv, proj = blocks(".attn.qkv"), blocks(".attn.proj")
    parts = {
        "MLP": blocks(".mlp.fc") + blocks(".mlp.proj"),
        "qkv": qkv,
        "out proj": proj,
        # attention's own matmuls: Q K^T and A V, what the block's attention ran
        # besides its two projections
        "attention": blocks(".attn") - qkv - proj,
        "head": by_module.get("GPT.lm_head", 0),
    }
    assert sum(parts.values()) == counter.get_total_flops(), parts
    return {part: 3 * n / x.numel() for part, n in parts.items()}


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
    ax.set_xlim(0, 1.6)  # room for the labels
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("MFU: fraction of the measured matmul peak")
    ax.set_title(title)
    fig.tight_layout()
    return fig
