"""Bytes of model state per rank: the ZeRO paper's count (Rajbhandari et al., arXiv
1910.02054, Section 5), a number of bytes per parameter for each part, divided by the
ranks that share the part when the strategy shards it.

    per_rank_bytes(7.5e9, ranks=64, dtype="bf16_mixed", strategy="zero1")  # 31.4 GB
"""

from __future__ import annotations

from distlab.costs.strategies import PARTS, STRATEGIES, strategy

# --- begin coefficients ---
# bytes per parameter of the weights and gradients the forward/backward pass uses, and
# of the fp32 copy of the weights that mixed precision keeps for the optimizer
# ("master" weights)
DTYPES = {
    "fp32": {"params": 4, "grads": 4, "master": 0},
    "bf16_mixed": {"params": 2, "grads": 2, "master": 4},
}
# fp32 optimizer state per parameter: AdamW's two moments, SGD's momentum buffer, plain
# SGD none
OPTIMIZERS = {"adamw": 8, "sgd_momentum": 4, "sgd": 0}
# --- end coefficients ---


def _choice(kind: str, value: str, options) -> None:
    if value not in options:
        raise ValueError(
            f"unknown {kind} {value!r}; choose one of {', '.join(options)}"
        )


def bytes_per_param(dtype: str = "fp32", optimizer: str = "adamw") -> dict[str, int]:
    """Bytes per parameter of each part when nothing is sharded.

    bf16 mixed precision with AdamW gives 2 + 2 + 12: the paper's 2Ψ + 2Ψ + KΨ with K =
    12 (fp32 master weights, momentum and variance); fp32 AdamW gives 4 + 4 + 8 = 16.
    """
    _choice("dtype", dtype, DTYPES)
    _choice("optimizer", optimizer, OPTIMIZERS)
    d = DTYPES[dtype]
    return {
        "params": d["params"],
        "grads": d["grads"],
        "optimizer": d["master"] + OPTIMIZERS[optimizer],
    }


def divisor(name: str, ranks: int, group_size: int | None = None) -> int:
    """How many ranks share each sharded part; checks the inputs on the way."""
    s = strategy(name)
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a whole number >= 1, got {ranks!r}")
    if s.shards_over == "ranks":
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
    """Model-state bytes on each rank: ``coef * n_params / (divisor if sharded else 1)``
    per part."""
    d = divisor(strategy, ranks, group_size)
    coef = bytes_per_param(dtype, optimizer)
    sharded = STRATEGIES[strategy].sharded
    out = {
        part: coef[part] * n_params / (d if part in sharded else 1) for part in PARTS
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
