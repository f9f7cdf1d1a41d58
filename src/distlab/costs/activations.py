"""Bytes one Llama block holds for backward, per token, under torchtitan's three
activation-checkpointing modes, tensor by tensor; and the share of the block's matmul
FLOPs torchtitan's selective-op policy recomputes.

    held_bytes_per_token(4096, 1024, 14336, 32, "selective-op", "bf16")["total"]
    sac_recompute_matmul_fraction(4096, 1024, 14336)  # 19456 / 53248 = 0.365

The block is torchtitan's Llama (``torchtitan/models/llama/model.py``): RMSNorm in its
own class (``self._norm(x.float()).type_as(x)``, then ``* self.weight``), q/k/v
projections, rotary embedding by a complex multiply on ``x.float()``, ``repeat_kv``,
causal SDPA, the output projection, RMSNorm, the SwiGLU FFN
``w2(silu(w1(x)) * w3(x))``, and two residual adds. The block input is left out
(the previous block's output, counted there) and so are the parameters. C is the model
width, kv = n_kv_head * head_dim, F the FFN width. ``distlab.planner.llama_block``
measures the same block on the CPU and a test holds the two equal.
"""

from __future__ import annotations

# bytes per value of the compute dtype; the norms' statistics, rotary's complex
# multiply and attention's log-sum-exp are fp32 in both
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP32 = 4
AC_MODES = ("none", "selective-op", "full")


def block_matmuls(C: int, kv: int, F: int) -> list[tuple[str, int, int]]:
    """The block's matmuls in the order its forward runs them, as (name, in, out).

    torchtitan's ``Attention.forward`` runs ``xq, xk, xv = self.wq(x), self.wk(x),
    self.wv(x)`` and ends with ``self.wo(output)``; ``FeedForward.forward`` is
    ``self.w2(F.silu(self.w1(x)) * self.w3(x))``, which Python evaluates w1, w3, w2.
    """
    return [
        ("wq", C, C),
        ("wk", C, kv),
        ("wv", C, kv),
        ("wo", C, C),
        ("w1", C, F),
        ("w3", C, F),
        ("w2", F, C),
    ]


def sac_saves(position: int) -> bool:
    """torchtitan's parity rule for the block's ``position``-th aten.mm (from 1):
    the policy counts mms and recomputes when ``meta[mm_count_key] % 2 == 0``."""
    return position % 2 == 1


def sac_recompute_matmul_fraction(C: int, kv: int, F: int) -> float:
    """Share of the block's forward matmul FLOPs the selective-op policy recomputes
    in backward (each matmul's FLOPs are proportional to in * out per token)."""
    mms = block_matmuls(C, kv, F)
    total = sum(i * o for _, i, o in mms)
    redone = sum(i * o for n, (_, i, o) in enumerate(mms, 1) if not sac_saves(n))
    return redone / total


def _check(ac: str, dtype: str) -> None:
    if ac not in AC_MODES:
        raise ValueError(f"unknown AC mode {ac!r}; choose one of {', '.join(AC_MODES)}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of fp32, bf16")


def held_bytes_per_token(
    C: int, kv: int, F: int, n_head: int, ac: str, dtype: str = "bf16"
) -> dict[str, int]:
    """Bytes per token one block holds from its forward for its backward, by tensor,
    plus ``"total"``. ``dtype`` is the compute dtype ("fp32" or "bf16")."""
    _check(ac, dtype)
    w = DTYPE_BYTES[dtype]
    upcast = dtype != "fp32"  # x.float() copies only when x is not fp32 already
    if ac == "full":
        # the checkpoint keeps only the block's inputs: x (left out) and freqs_cis
        terms: dict[str, int] = {}
    elif ac == "selective-op":
        # the policy saves each odd-numbered aten.mm's output (the rest are
        # recomputed) and SDPA's outputs: attention and its log-sum-exp
        terms = {
            f"{name}.out": w * out
            for n, (name, _, out) in enumerate(block_matmuls(C, kv, F), 1)
            if sac_saves(n)
        }
        terms["sdpa.out"] = w * C
        terms["sdpa.lse"] = FP32 * n_head
    else:
        terms = {
            # x.float(): pow and the mul by 1/rms keep it; in fp32 it is x itself
            "attention_norm.x_fp32": FP32 * C if upcast else 0,
            # rsqrt keeps its result, one fp32 value per token
            "attention_norm.rstd": FP32,
            # type_as(x)'s output: the mul by the weight keeps it
            "attention_norm.normed": w * C,
            # the norm's output: wq, wk and wv's mms keep it (one tensor)
            "attention_norm.out": w * C,
            # rotary's output for q (type_as copy; in fp32 the complex product):
            # SDPA keeps it as the query. wq's output itself is not kept: the
            # complex multiply by freqs_cis (no grad) saves only freqs_cis
            "rotary.q": w * C,
            # repeat_kv's expand + reshape copies k and v to n_head heads, and SDPA
            # keeps the copies (without GQA they are rotary's k and wv's output)
            "repeat_kv.k": w * C,
            "repeat_kv.v": w * C,
            # SDPA's output: SDPA keeps it for its backward and wo's mm as its input
            # (one storage: the kernel writes it (B, T, H, D), so the transpose's
            # .contiguous() copies nothing)
            "sdpa.out": w * C,
            "sdpa.lse": FP32 * n_head,
            # h = x + attention: ffn_norm's h.float() (a copy in bf16, h in fp32)
            "ffn_norm.h_fp32": FP32 * C,
            "ffn_norm.rstd": FP32,
            "ffn_norm.normed": w * C,
            # w1 and w3's mms keep it
            "ffn_norm.out": w * C,
            # silu keeps its input, the product keeps both factors, w2's mm the
            # product
            "w1.out": w * F,
            "silu.out": w * F,
            "w3.out": w * F,
            "silu_x_w3.out": w * F,
        }
    terms = {k: v for k, v in terms.items() if v}
    terms["total"] = sum(terms.values())
    return terms


def held_values_per_token(
    C: int, kv: int, F: int, n_head: int, ac: str, dtype: str = "bf16"
) -> float:
    """``held_bytes_per_token``'s total in values of the compute dtype."""
    total = held_bytes_per_token(C, kv, F, n_head, ac, dtype)["total"]
    return total / DTYPE_BYTES[dtype]


# --- begin gpt2 block ---
def gpt2_block_bytes_per_token(C: int, F: int, n_head: int, w: int) -> int:
    """Bytes one block of the book's GPT (``distlab.model``: LayerNorm, fused causal
    attention, a GELU MLP of width F, biases) keeps for backward per token, its input
    included, computing with ``w``-byte values: the LayerNorm 1 input (C) and its
    output as the qkv input (C), the qkv output attention keeps as q, k, v (3C), the
    attention output (C; the head merge copies nothing, the kernel already lays it out
    as (B, T, H, C/H)), the LayerNorm 2 input and output (2C), the MLP's hidden before
    GELU and after it (2F): 16C when F = 4C. Small terms: each LayerNorm's mean and
    1/std in the compute dtype (as the CPU keeps them) and attention's log-sum-exp,
    one fp32 value per head."""
    return w * (8 * C + 2 * F) + 2 * 2 * w + FP32 * n_head


# --- end gpt2 block ---
