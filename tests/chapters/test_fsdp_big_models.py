"""A model bigger than one rank: the exercise's checker (block and row fills pass, a
per-shard seed fails). The page itself (book/fsdp_big_models.md) runs the tour on 2
ranks and the HSDP clip on 4 and asserts on every build what they measure: the init on
shards, the full state dict loaded by broadcast, or read from safetensors by each rank,
and saved to rank 0 (bytes and collectives), clip_grad_norm_ over DTensor gradients,
and the clip called on rank 0 only failing with the group's timeout."""

import pytest
import torch

from distlab.chapters.fsdp_big_models import fill_rows_
from distlab.exercises.fsdp_big_models import check_fill_blocks


def fill_blocks_(local, first_row, key, std, rows_per_block):
    first_block = first_row // rows_per_block
    last_block = (first_row + local.shape[0] - 1) // rows_per_block
    for b in range(first_block, last_block + 1):
        gen = torch.Generator().manual_seed(key * 1_000_003 + b)
        block = torch.randn((rows_per_block, *local.shape[1:]), generator=gen) * std
        lo, hi = (
            max(first_row, b * rows_per_block),
            min(first_row + local.shape[0], (b + 1) * rows_per_block),
        )
        local[lo - first_row : hi - first_row] = block[
            lo - b * rows_per_block : hi - b * rows_per_block
        ]


def test_checker_passes_block_and_row_fills_and_catches_a_per_shard_seed(capsys):
    check_fill_blocks(fill_blocks_)
    check_fill_blocks(
        lambda local, first, key, std, block: fill_rows_(local, first, key, std)
    )
    assert capsys.readouterr().out.count("passed") == 2

    def per_shard(local, first_row, key, std, rows_per_block):
        local.copy_(
            torch.randn(local.shape, generator=torch.Generator().manual_seed(key)) * std
        )

    with pytest.raises(AssertionError, match="differs from the one-rank fill"):
        check_fill_blocks(per_shard)
    with pytest.raises(ValueError, match="must be a function"):
        check_fill_blocks("fill")
