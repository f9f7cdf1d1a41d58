"""Training FLOPs per token, the count MFU reports use: one formula for the book's GPT
(``distlab.flops``) and the planner's shapes (``distlab.planner.shapes``)."""

from __future__ import annotations


# --- begin flops ---
def training_flops_per_token(
    matmul_params: int, n_layer: int, d_model: int, seq_len: int
) -> int:
    """6 per matmul weight (a multiply-add forward, two backward: the gradients of the
    input and of the weight), plus 12*L*C*T for attention's scores and weighted sum
    (2*T*C each per token per layer forward, 3x with backward), the causal mask's
    skipped half counted, as the PaLM paper's appendix B and MFU reports count it."""
    return 6 * matmul_params + 12 * n_layer * d_model * seq_len


# --- end flops ---
