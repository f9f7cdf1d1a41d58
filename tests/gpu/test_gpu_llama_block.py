"""What one torchtitan Llama block holds for backward on a GPU, in bf16 with the flash
attention kernel torchtitan's runs used: the count the planner uses
(``distlab.costs.activations``) against the measurement (``planner.llama_block``).
The CPU check of the same count is tests/unit/test_llama_block.py; on CUDA the flash
kernel also keeps its random seed and offset, a few bytes not per token."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from distlab.costs.activations import held_bytes_per_token
from distlab.planner.llama_block import BlockShape, measure_held
from support.gpu import GPU_MODULE

pytestmark = GPU_MODULE

SHAPE = BlockShape(dim=1024, n_head=8, n_kv_head=2, ffn_hidden=3584)


@pytest.mark.parametrize("ac", ["none", "selective-op", "full"])
def test_a_block_holds_on_cuda_what_the_planner_counts(ac):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        held = measure_held(
            SHAPE, ac, torch.bfloat16, batch=2, seq_len=1024, device="cuda"
        )
    expected = held_bytes_per_token(
        SHAPE.dim, SHAPE.kv_dim, SHAPE.ffn_hidden, SHAPE.n_head, ac, "bf16"
    )["total"]
    assert abs(held.nbytes - expected * held.tokens) <= 256, (ac, held.per_token)
