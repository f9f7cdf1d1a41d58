"""How many bytes each rank holds under DDP, ZeRO-1/2/3, FSDP2 and hybrid sharding.

    # the ZeRO paper's 31.4 GB
    per_rank_bytes(7.5e9, ranks=64, dtype="bf16_mixed", strategy="zero1")
    estimate("shakespeare", ranks=4, strategy="fsdp2", micro_batch=16, seq_len=256)

Model state is counted as the ZeRO paper counts it (Rajbhandari et al., arXiv
1910.02054, Section 5): a number of bytes per parameter for each part (parameters,
gradients, optimizer state), divided by the number of ranks that share the part when the
strategy shards it. On top of that model state, ``estimate`` adds the two things a step
holds for a while: the whole parameters FSDP2 gathers (``gathered_params``), and the
activations at their peak in backward (``activation_bytes``), both in the precision the
forward computes in. Activations are not sharded by data parallelism: each rank keeps
those of its own micro-batch.

This module is the one source of truth: the page in ``distlab.tools.calculator_page``
(HTML form and ipywidgets) only multiplies the coefficients ``calculator_data()``
exports. What the formulas are checked against: ``distlab.tools.memory_checks`` (the
paper's Table 1, the exact layout of DDP and FSDP2 state) and the ZeRO memory chapter's
measurements on real ranks (``distlab.chapters.zero_memory``).
"""

from __future__ import annotations

import torch

from distlab.costs.state import (
    DTYPES,
    OPTIMIZERS,
    _choice,
    bytes_per_param,
    per_rank_bytes,
)
from distlab.costs.strategies import PARTS, STRATEGIES
from distlab.model import Block, GPTConfig, parameter_formula, preset
from distlab.planner.predict import activation_terms
from distlab.planner.shapes import from_gpt_config

GB = 1e9  # the ZeRO paper's GB: 16 bytes x 7.5e9 parameters = 120e9 bytes, its "120 GB"


GPT2_SMALL = GPTConfig(
    vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768
)
# the calculator's models; the paper's 7.5B is a parameter count without an
# architecture, so it (and a free parameter count) has no activation estimate
MODELS: dict[str, dict] = {
    "tiny": {"label": "tiny (this book)", "config": preset("tiny")},
    "shakespeare": {"label": "shakespeare (10.8M)", "config": preset("shakespeare")},
    "gpt2": {"label": "GPT-2 small (124M)", "config": GPT2_SMALL},
    "paper_7.5b": {"label": "ZeRO paper's 7.5B", "params": 7.5e9},
}


# bytes per activation value: the precision the forward computes in
VALUE_BYTES = {"fp32": 4, "bf16_mixed": 2}
MOMENTS = ("loss", "last block")  # where backward can reach its peak


def activation_bytes(
    cfg: GPTConfig,
    batch: int,
    seq_len: int,
    checkpointing: bool = False,
    dtype: str = "fp32",
) -> dict[str, int | str]:
    """Activation bytes on one rank for a micro-batch of ``batch`` sequences
    of ``seq_len``.

    The planner's count (``distlab.planner.predict.activation_terms``), for the book's
    GPT. ``saved``: what autograd keeps after the forward pass. Without checkpointing,
    every block's saved tensors (``activation_bytes_formula``). With each block
    checkpointed, only each block's (B, T, C) input, plus what the layers outside the
    blocks save. ``recompute``: with checkpointing, one block's saved tensors, rebuilt
    in backward. ``peak`` is ``saved`` plus the most that backward adds at one moment,
    ``at`` one of two:
    * "loss": log-softmax's backward holds the gradients of its output and of the
      logits, two (B, T, V) fp32 tensors (fp32 in bf16 too: the loss is computed from
      logits.float());
    * "last block": the recomputed block, if any, and the MLP's backward: the gradients
      of the block's output (BTC) and of the hidden layer (4BTC), the down-projection's
      weight and bias gradients (4C^2 + C) and the tied head's weight gradient, held
      until the embedding's is added to it (VC); by then the log-softmax output (BTV,
      fp32) and the final LayerNorm's tensors (2BTC + 2BT) are freed.
    The caller must drop the logits (``model(x, y)[1]``); keeping them adds (B, T, V)
    values.
    """
    if batch < 1 or not 1 <= seq_len <= cfg.block_size:
        raise ValueError(
            f"need batch >= 1 and 1 <= seq_len <= block_size {cfg.block_size}, "
            f"got batch={batch}, seq_len={seq_len}"
        )
    _choice("dtype", dtype, VALUE_BYTES)
    shape = from_gpt_config("model", "model", cfg, "distlab.model")
    terms = activation_terms(
        shape,
        batch,
        seq_len,
        "full" if checkpointing else "none",
        1,
        VALUE_BYTES[dtype],
    )
    return {k: terms[k] for k in ("saved", "recompute", "peak", "at", "added")}


def activation_coefficients(
    cfg: GPTConfig, checkpointing: bool, dtype: str
) -> list[dict[str, int]]:
    """The ``peak`` as the larger of two affine functions of (B*T, T, 1), one per moment
    of ``MOMENTS``: bytes per token (x B*T), per position (x T) and a constant.

    Each moment's bytes are exact and affine, so three evaluations give its three
    coefficients; two more check that it still is affine. The page's script takes the
    larger of the two.
    """
    out = []
    for moment in MOMENTS:

        def f(b: int, t: int, moment: str = moment) -> int:
            a = activation_bytes(cfg, b, t, checkpointing, dtype)
            return a["saved"] + a["added"][moment]

        per_token = f(2, 1) - f(1, 1)
        per_position = f(1, 2) - f(1, 1) - per_token
        constant = f(1, 1) - per_token - per_position
        for b, t in ((3, 2), (2, 2)):
            assert f(b, t) == per_token * b * t + per_position * t + constant, (
                "activations not affine"
            )
        out.append(
            {"per_token": per_token, "per_position": per_position, "constant": constant}
        )
    return out


def model_params(model: str) -> float:
    _choice("model", model, MODELS)
    spec = MODELS[model]
    return spec["params"] if "params" in spec else parameter_formula(spec["config"])


def fsdp2_unit_params(cfg: GPTConfig) -> dict[str, int]:
    """Parameters of one block and of the root (the rest: embeddings, final LayerNorm;
    the head is tied) when each block is an FSDP2 unit, as
    ``distlab.parallel.apply_fsdp`` makes them."""
    with torch.device("meta"):  # shapes only, no memory
        block = sum(p.numel() for p in Block(cfg).parameters())
    return {"block": block, "root": parameter_formula(cfg) - cfg.n_layer * block}


def gathered_params(
    strategy: str, n_params: float, cfg: GPTConfig | None
) -> float | None:
    """Whole parameters held on top of the shards at the peak of a step: none for DDP
    and ZeRO-1/2 (their parameters are whole anyway); the root plus two blocks' worth
    under FSDP2 with resharding, which needs the architecture (None without one);
    every unit without (the end of forward also holds the last block's all-gather
    buffer, which this leaves out)."""
    kind = STRATEGIES[strategy].gathered
    if kind is None:
        return 0
    if kind == "model":
        return n_params
    if cfg is None:
        return None
    units = fsdp2_unit_params(cfg)
    return units["root"] + min(2, cfg.n_layer) * units["block"]


def estimate(
    model: str | float,
    ranks: int,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    strategy: str = "ddp",
    group_size: int | None = None,
    micro_batch: int = 8,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
) -> dict:
    """Everything the calculator shows: bytes per rank of each part and the total.

    ``model`` is a name in ``MODELS`` or a number of parameters. ``gathered``: whole
    parameters in the compute dtype that FSDP2 holds at the peak (``gathered_params``);
    ``activations``: their peak (``activation_bytes``) in the compute dtype. Both need a
    GPT config where they depend on the architecture, and are ``None`` (not counted) for
    the 7.5B and free-count models.
    """
    n_params = model if isinstance(model, (int, float)) else model_params(model)
    out = per_rank_bytes(n_params, ranks, dtype, optimizer, strategy, group_size)
    cfg = MODELS[model].get("config") if isinstance(model, str) else None
    gathered = gathered_params(strategy, n_params, cfg)
    out["gathered"] = None if gathered is None else DTYPES[dtype]["params"] * gathered
    out["activations"] = None
    if cfg is not None:
        seq_len = seq_len or cfg.block_size
        out["activations"] = activation_bytes(
            cfg, micro_batch, seq_len, activation_checkpointing, dtype
        )["peak"]
    out["total"] = out["total"] + (out["gathered"] or 0) + (out["activations"] or 0)
    return out


def calculator_data() -> dict:
    """The coefficient table the HTML calculator (``distlab.tools.calculator_page``)
    multiplies, exported from the functions above."""
    models = {}
    for name, spec in MODELS.items():
        cfg = spec.get("config")
        models[name] = {
            "label": spec["label"],
            "params": model_params(name),
            "block_size": cfg.block_size if cfg else None,
            "gathered_units": gathered_params("fsdp2", model_params(name), cfg),
            "activations": {
                d: {
                    "off": activation_coefficients(cfg, False, d),
                    "on": activation_coefficients(cfg, True, d),
                }
                for d in VALUE_BYTES
            }
            if cfg
            else None,
        }
    return {
        "parts": list(PARTS),
        "bytes_per_param": {
            d: {o: bytes_per_param(d, o) for o in OPTIMIZERS} for d in DTYPES
        },
        "strategies": {
            s: {
                "label": v.label,
                "divisor": v.shards_over,
                "sharded": {p: p in v.sharded for p in PARTS},
                "gathered": v.gathered,
            }
            for s, v in STRATEGIES.items()
        },
        "models": models,
    }
