"""What one torchtitan Llama block holds for backward: the CPU measurement
(``distlab.planner.llama_block``) equals the count on paper
(``distlab.costs.activations``), byte for byte, for each AC mode and dtype."""

import pytest
import torch

from distlab.costs.activations import (
    held_bytes_per_token,
    sac_recompute_matmul_fraction,
)
from distlab.planner.llama_block import BlockShape, held_by, measure_held

SMALL = BlockShape(dim=256, n_head=4, n_kv_head=2, ffn_hidden=704)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def formula(shape: BlockShape, ac: str, dtype: str) -> dict[str, int]:
    return held_bytes_per_token(
        shape.dim, shape.kv_dim, shape.ffn_hidden, shape.n_head, ac, dtype
    )


def test_the_measurement_is_exact_on_a_trivial_case():
    x = torch.randn(3, 5, requires_grad=True)
    # sin keeps its input, x * 2: 15 fp32 values; the output is left out
    _, held = held_by(lambda x: (x * 2).sin(), x)
    assert sum(t.nbytes for t in held.values()) == 15 * 4
    # an add keeps nothing, so x * 2 is freed as soon as the add has run
    _, held = held_by(lambda x: x * 2 + 1, x)
    assert held == {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ac", ["none", "selective-op", "full"])
def test_measured_bytes_equal_the_formula_tensor_by_tensor(ac, dtype):
    # every term is a whole number of bytes per token (the norms' 1/rms and the
    # log-sum-exp included), so the agreement is exact, not within a tolerance
    held = measure_held(SMALL, ac, DTYPES[dtype], batch=2, seq_len=64)
    terms = formula(SMALL, ac, dtype)
    assert held.per_token == terms["total"]
    measured = sorted(t.nbytes // held.tokens for t in held.tensors)
    assert measured == sorted(v for k, v in terms.items() if k != "total")


def test_without_ac_every_held_tensor_is_one_autograd_saved():
    held = measure_held(SMALL, "none", torch.bfloat16)
    assert all(t.saved_by for t in held.tensors)
    saved = {name for t in held.tensors for name in t.saved_by}
    assert "ScaledDotProductFlashAttentionForCpuBackward0.logsumexp" in saved


def test_flipping_the_policy_parity_breaks_the_agreement():
    # saving the even mms (wk, wo, w3) instead of the odd ones: the test can fail
    held = measure_held(SMALL, "selective-op", torch.float32, parity=1)
    assert held.per_token != formula(SMALL, "selective-op", "fp32")["total"]


def test_llama3_8b_recomputes_365_per_mille_of_the_matmul_flops():
    # wk + wo + w3 over all seven, in units of 4096 * 4096
    assert sac_recompute_matmul_fraction(4096, 1024, 14336) == 19456 / 53248
    assert round(19456 / 53248, 3) == 0.365
