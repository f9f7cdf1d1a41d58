"""How many bytes each rank holds under DDP, ZeRO-1/2/3, FSDP2 and hybrid sharding.

    per_rank_bytes(7.5e9, ranks=64, dtype="bf16_mixed", strategy="zero1")  # the ZeRO paper's 31.4 GB
    estimate("shakespeare", ranks=4, strategy="zero3", micro_batch=16, seq_len=256)
    exact_adamw_state_bytes(shapes, ranks=4, rank=3, fsdp2=True)  # to the byte, from the shapes

Model state is counted as the ZeRO paper counts it (Rajbhandari et al., arXiv 1910.02054,
Section 5): a number of bytes per parameter for each part (parameters, gradients, optimizer
state), divided by the number of ranks that share the part when the strategy shards it.
Activations are not sharded by data parallelism: each rank keeps those of its own
micro-batch. This module is the one source of truth: the page in ``distlab.tools.calculator_page``
(HTML form and ipywidgets) only multiplies the coefficients ``calculator_data()`` exports. The
bytes measured on real DDP and FSDP2 ranks, to check these formulas against, are an experiment
of the ZeRO memory chapter: ``distlab.chapters.zero_memory.measure_one_step``.
"""

from __future__ import annotations

import math

from distlab.memory import activation_bytes_formula
from distlab.model import GPTConfig, parameter_formula, preset

GB = 1e9  # the ZeRO paper's GB: 16 bytes x 7.5e9 parameters = 120e9 bytes, its "120 GB"
PARTS = ("params", "grads", "optimizer")

# --- begin coefficients ---
# bytes per parameter of the weights and gradients the forward/backward pass uses, and of the
# fp32 copy of the weights that mixed precision keeps for the optimizer ("master" weights)
DTYPES = {"fp32": {"params": 4, "grads": 4, "master": 0}, "bf16_mixed": {"params": 2, "grads": 2, "master": 4}}
# fp32 optimizer state per parameter: AdamW's two moments, SGD's momentum buffer, plain SGD none
OPTIMIZERS = {"adamw": 8, "sgd_momentum": 4, "sgd": 0}
# --- end coefficients ---

# --- begin strategies ---
# which parts each strategy divides, and by how many ranks ("ranks": all N, "group": g)
STRATEGIES = {
    "ddp": {"label": "DDP (no sharding)", "sharded": (), "divisor": "ranks"},
    "zero1": {"label": "ZeRO-1: optimizer state", "sharded": ("optimizer",), "divisor": "ranks"},
    "zero2": {"label": "ZeRO-2: + gradients", "sharded": ("optimizer", "grads"), "divisor": "ranks"},
    "zero3": {"label": "ZeRO-3 = FSDP2 fully_shard", "sharded": PARTS, "divisor": "ranks"},
    # reshard_after_forward=False keeps every unit's gathered parameters from forward to
    # backward, so during the step the parameters are whole on every rank, as in ZeRO-2
    "fsdp2_no_reshard": {
        "label": "FSDP2 reshard_after_forward=False",
        "sharded": ("optimizer", "grads"),
        "divisor": "ranks",
    },
    "hybrid": {"label": "hybrid: shard in groups of g, replicate across", "sharded": PARTS, "divisor": "group"},
}
# --- end strategies ---

GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
# the calculator's models; the paper's 7.5B is a parameter count without an architecture,
# so it (and a free parameter count) has no activation estimate
MODELS: dict[str, dict] = {
    "tiny": {"label": "tiny (this book)", "config": preset("tiny")},
    "shakespeare": {"label": "shakespeare (10.8M)", "config": preset("shakespeare")},
    "gpt2": {"label": "GPT-2 small (124M)", "config": GPT2_SMALL},
    "paper_7.5b": {"label": "ZeRO paper's 7.5B", "params": 7.5e9},
}


def _choice(kind: str, value: str, options) -> None:
    if value not in options:
        raise ValueError(f"unknown {kind} {value!r}; choose one of {', '.join(options)}")


def bytes_per_param(dtype: str = "fp32", optimizer: str = "adamw") -> dict[str, int]:
    """Bytes per parameter of each part when nothing is sharded.

    bf16 mixed precision with AdamW gives 2 + 2 + 12: the paper's 2Ψ + 2Ψ + KΨ with K = 12
    (fp32 master weights, momentum and variance); fp32 AdamW gives 4 + 4 + 8 = 16.
    """
    _choice("dtype", dtype, DTYPES)
    _choice("optimizer", optimizer, OPTIMIZERS)
    d = DTYPES[dtype]
    return {"params": d["params"], "grads": d["grads"], "optimizer": d["master"] + OPTIMIZERS[optimizer]}


def divisor(strategy: str, ranks: int, group_size: int | None = None) -> int:
    """How many ranks share each sharded part; checks the inputs on the way."""
    _choice("strategy", strategy, STRATEGIES)
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")
    if STRATEGIES[strategy]["divisor"] == "ranks":
        return ranks
    if not isinstance(group_size, int) or group_size < 1 or ranks % group_size:
        raise ValueError(
            f"hybrid sharding needs a group size g that divides the {ranks} ranks "
            f"(shard within g, replicate across ranks/g), got g={group_size!r}"
        )
    return group_size


def per_rank_bytes(
    n_params: float,
    ranks: int,
    dtype: str = "fp32",
    optimizer: str = "adamw",
    strategy: str = "ddp",
    group_size: int | None = None,
) -> dict[str, float]:
    """Model-state bytes on each rank: ``coef * n_params / (divisor if sharded else 1)`` per part."""
    d = divisor(strategy, ranks, group_size)
    coef = bytes_per_param(dtype, optimizer)
    sharded = STRATEGIES[strategy]["sharded"]
    out = {part: coef[part] * n_params / (d if part in sharded else 1) for part in PARTS}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def zero_paper_bytes(psi: float, n_d: int, stage: int, k: int = 12) -> float:
    """The paper's own formulas (its Figure 1): baseline (2+2+K)Ψ, P_os 4Ψ + KΨ/N_d,
    P_os+g 2Ψ + (2+K)Ψ/N_d, P_os+g+p (4+K)Ψ/N_d."""
    return [(4 + k) * psi, 4 * psi + k * psi / n_d, 2 * psi + (2 + k) * psi / n_d, (4 + k) * psi / n_d][stage]


# Table 1 of the paper (arXiv 1910.02054, Section 5.2), per-device GB, printed as strings
# because the printed digits are part of the check: {model: {stage: [N_d=1, 4, 16, 64, 256, 1024]}}
PAPER_DP = (1, 4, 16, 64, 256, 1024)
PAPER_TABLE_1 = {
    7.5e9: {1: "120 52.5 35.6 31.4 30.4 30.1", 2: "120 41.3 21.6 16.6 15.4 15.1", 3: "120 30 7.5 1.88 0.47 0.12"},
    128e9: {1: "2048 896 608 536 518 513", 2: "2048 704 368 284 263 257", 3: "2048 512 128 32 8 2"},
    1e12: {
        1: "16000 7000 4750 4187 4046 4011",
        2: "16000 5500 2875 2218 2054 2013",
        3: "16000 4000 1000 250 62.5 15.6",
    },
}


def agrees_with_print(value: float, printed: str) -> str | None:
    """'rounded' or 'truncated' if ``value`` printed to ``printed``'s decimals gives it, else None."""
    decimals = len(printed.partition(".")[2])
    scale = 10**decimals
    if math.floor(value * scale + 0.5 + 1e-9) / scale == float(printed):
        return "rounded"
    if math.floor(value * scale + 1e-9) / scale == float(printed):
        return "truncated"
    return None


# --- begin activations ---
def activation_bytes(cfg: GPTConfig, batch: int, seq_len: int, checkpointing: bool = False) -> dict[str, int]:
    """Activation bytes on one rank for a micro-batch of ``batch`` sequences (fp32).

    ``saved``: what autograd keeps after the forward pass. Without checkpointing, every
    block's saved tensors (``activation_bytes_formula``). With each block checkpointed, only
    each block's input, B*T*C fp32 values, plus what the layers outside the blocks save.
    ``peak`` adds, with checkpointing, one block's saved tensors: the backward pass recomputes
    one block at a time and holds its activations until that block's backward is done.
    """
    if batch < 1 or not 1 <= seq_len <= cfg.block_size:
        raise ValueError(
            f"need batch >= 1 and 1 <= seq_len <= block_size {cfg.block_size}, got batch={batch}, seq_len={seq_len}"
        )
    full = activation_bytes_formula(cfg, batch, seq_len)
    if not checkpointing:
        return {"saved": full["total"], "recompute": 0, "peak": full["total"]}
    kept_inputs = cfg.n_layer * 4 * batch * seq_len * cfg.n_embd  # (B, T, C) fp32 per block
    saved = kept_inputs + full["outside_blocks"]
    return {"saved": saved, "recompute": full["per_block"], "peak": saved + full["per_block"]}


# --- end activations ---


def activation_coefficients(cfg: GPTConfig, checkpointing: bool) -> dict[str, int]:
    """``peak`` activations as bytes per token (x B*T), per position (x T) and a constant.

    The formula is exact and affine in (B*T, T, 1), so three evaluations give the three
    coefficients; two more check that it still is affine.
    """
    f = lambda b, t: activation_bytes(cfg, b, t, checkpointing)["peak"]  # noqa: E731
    per_token = f(2, 1) - f(1, 1)
    per_position = f(1, 2) - f(1, 1) - per_token
    constant = f(1, 1) - per_token - per_position
    for b, t in ((3, 2), (2, 2)):
        assert f(b, t) == per_token * b * t + per_position * t + constant, "activations not affine"
    return {"per_token": per_token, "per_position": per_position, "constant": constant}


def model_params(model: str) -> float:
    _choice("model", model, MODELS)
    spec = MODELS[model]
    return spec["params"] if "params" in spec else parameter_formula(spec["config"])


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

    ``model`` is a name in ``MODELS`` or a number of parameters; activations (peak, fp32)
    need a GPT config, so they are ``None`` for the 7.5B and free-count models.
    """
    n_params = model if isinstance(model, (int, float)) else model_params(model)
    out = per_rank_bytes(n_params, ranks, dtype, optimizer, strategy, group_size)
    cfg = MODELS[model].get("config") if isinstance(model, str) else None
    out["activations"] = None
    if cfg is not None:
        out["activations"] = activation_bytes(cfg, micro_batch, seq_len or cfg.block_size, activation_checkpointing)[
            "peak"
        ]
        out["total"] = out["total"] + out["activations"]
    return out


def fsdp2_local_rows(rows: int, ranks: int, rank: int) -> int:
    """Rows of a dim-0-sharded tensor on ``rank``: chunks of ceil(rows/N); the last ranks
    may hold fewer, or none."""
    chunk = -(-rows // ranks)
    return max(0, min(rows, (rank + 1) * chunk) - rank * chunk)


def exact_adamw_state_bytes(
    shapes: list[tuple[int, ...]], ranks: int, rank: int, fsdp2: bool, storage: bool = False
) -> dict[str, int]:
    """fp32 AdamW state on one rank, tensor by tensor, as DDP or FSDP2 lays it out.

    Under FSDP2 each tensor is split along dim 0. ``storage=False`` counts what ``to_local()``
    shows (``distlab.memory.state_bytes``); ``storage=True`` counts the memory allocated:
    FSDP2 pads parameters and gradients to ceil(rows/N) rows on every rank, while AdamW's
    moments (``zeros_like`` of the local shard) are not padded. AdamW also keeps a 4-byte
    ``step`` tensor per parameter tensor.
    """
    local = padded = 0
    for shape in shapes:
        rows, per_row = shape[0], math.prod(shape[1:])
        local += per_row * (fsdp2_local_rows(rows, ranks, rank) if fsdp2 else rows)
        padded += per_row * (-(-rows // ranks) if fsdp2 else rows)
    weights = 4 * (padded if storage else local)
    out = {"params": weights, "grads": weights, "optimizer": 2 * 4 * local + 4 * len(shapes)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def calculator_data() -> dict:
    """The coefficient table the HTML calculator (``distlab.tools.calculator_page``) multiplies,
    exported from the functions above."""
    models = {}
    for name, spec in MODELS.items():
        cfg = spec.get("config")
        models[name] = {
            "label": spec["label"],
            "params": model_params(name),
            "block_size": cfg.block_size if cfg else None,
            "activations": {"off": activation_coefficients(cfg, False), "on": activation_coefficients(cfg, True)}
            if cfg
            else None,
        }
    return {
        "parts": list(PARTS),
        "bytes_per_param": {d: {o: bytes_per_param(d, o) for o in OPTIMIZERS} for d in DTYPES},
        "strategies": {
            s: {"label": v["label"], "divisor": v["divisor"], "sharded": {p: p in v["sharded"] for p in PARTS}}
            for s, v in STRATEGIES.items()
        },
        "models": models,
    }
