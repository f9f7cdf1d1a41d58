"""A model bigger than one rank: meta-device init and a sharding-independent init, a full state dict
loaded by broadcast from rank 0 (equal to one process; bytes and collectives counted), a full dict
saved from the shards, clip_grad_norm_ over DTensor gradients (norm and clipped gradients equal to
one process's; a clip that only rank 0 calls times out in one line), and the exercise's checker."""

import pytest
import torch

from distlab.chapters.fsdp_big_models import fill_rows_
from distlab.exercises.fsdp_big_models import check_fill_blocks
from distlab.infra.observe import observe


@pytest.fixture(scope="module")
def tour():
    from distlab.chapters.fsdp_big_models import tour

    outcome = observe(tour, nprocs=2, pg_timeout=60, timeout=120)
    assert outcome.failure is None, outcome.failure
    return outcome.results


def test_random_init_on_cpu_shards_repeats_the_stream_and_row_init_does_not(tour):
    for rank, r in enumerate(tour):
        init = r["init"]
        assert "may not have complete support on cpu" in init["warning"]  # no RNG tracker on CPU
        assert not init["equal_to_one_process"]
        assert init["rows_equal_stream_start"] == init["local_rows"] == (33, 32)[rank]  # every shard: the same draws
        assert init["rows_of_whole_equal"] == 33  # only rank 0's rows match one process
        assert init["init_rows_max_diff"] == 0.0


def test_full_state_dict_broadcast_from_rank0(tour):
    zero, one = tour[0]["load"], tour[1]["load"]
    assert zero["tensors in the dict"] == 29 and one["tensors in the dict"] == 0
    assert zero["collectives"] == one["collectives"] == {"broadcast": 29 + 2}  # a tensor each + the metadata
    assert zero["dict bytes"] == 2 * zero["shard bytes"] - 64 * 4  # the shards pad 65 rows to 2 x 33
    # rank 0: its dict and its shards, nothing whole besides; rank 1: its shards and one whole tensor at a time
    assert zero["shard bytes"] + zero["dict bytes"] <= zero["peak"] < zero["shard bytes"] + zero["dict bytes"] + 4096
    largest = 256 * 64 * 4  # the MLP's matrix: each is broadcast whole, one at a time
    assert zero["largest broadcast"] == one["largest broadcast"] == largest
    assert one["shard bytes"] + largest <= one["peak"] <= one["shard bytes"] + 2 * largest
    assert zero["dict now holds"] == ["DTensor"]  # the caller's dict was rewritten in place
    for r in tour:
        assert r["loaded"] == {"max param diff": 0.0, "max logit diff": 0.0}


def test_full_state_dict_saved_to_rank0_only(tour):
    zero, one = tour[0]["save"], tour[1]["save"]
    assert zero["collectives"] == one["collectives"] == {"all_gather": 29}  # the tied weight twice
    assert zero["keys"] == 29 and zero["max diff"] == 0.0 and zero["types"] == ["Tensor"]
    assert one["keys"] == 0
    shards = tour[0]["load"]["shard bytes"]  # rank 0 keeps the dict; rank 1 one gathered tensor at a time
    assert 0 <= zero["peak"] - zero["dict bytes"] - shards <= 65_536
    assert 65_536 <= one["peak"] - tour[1]["load"]["shard bytes"] <= 2 * 65_536


def test_clip_grad_norm_over_dtensor_gradients(tour):
    for r in tour:
        clip = r["clip"]
        assert clip["collectives"] == {"all_reduce": 1}
        assert clip["norm type"] == "DTensor (Replicate(),)"
        assert abs(clip["norm"] - clip["one-process norm"]) <= 1e-6 * clip["one-process norm"]
        assert clip["norm"] > 0.5  # so clipping did scale the gradients
        assert clip["max clipped-grad diff"] <= 1e-6 * clip["max grad"]


def test_clip_on_rank0_only_times_out_in_one_line(tour):
    error = tour[0]["rank0_only"]["error"]
    assert "Timed out waiting 2000ms" in error and "\n" not in error
    assert 1.9 < tour[0]["rank0_only"]["waited_s"] < 10
    assert tour[1]["rank0_only"]["error"] is None


def fill_blocks_(local, first_row, key, std, rows_per_block):
    first_block = first_row // rows_per_block
    last_block = (first_row + local.shape[0] - 1) // rows_per_block
    for b in range(first_block, last_block + 1):
        gen = torch.Generator().manual_seed(key * 1_000_003 + b)
        block = torch.randn((rows_per_block, *local.shape[1:]), generator=gen) * std
        lo, hi = max(first_row, b * rows_per_block), min(first_row + local.shape[0], (b + 1) * rows_per_block)
        local[lo - first_row : hi - first_row] = block[lo - b * rows_per_block : hi - b * rows_per_block]


def test_checker_passes_block_and_row_fills_and_catches_a_per_shard_seed(capsys):
    check_fill_blocks(fill_blocks_)
    check_fill_blocks(lambda local, first, key, std, block: fill_rows_(local, first, key, std))
    assert capsys.readouterr().out.count("passed") == 2

    def per_shard(local, first_row, key, std, rows_per_block):
        local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(key)) * std)

    with pytest.raises(AssertionError, match="differs from the one-rank fill"):
        check_fill_blocks(per_shard)
    with pytest.raises(ValueError, match="must be a function"):
        check_fill_blocks("fill")
