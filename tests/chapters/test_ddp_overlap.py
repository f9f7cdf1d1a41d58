"""The comm hooks' PowerSGD formula on fixed shapes, and the exercise checker catching a
wrong hook. The page checks its own launches on every build (the timeline's order of
events on both wrappers, the bytes of every hook against the formula, the losses
against fp32)."""

import pytest
import torch
import torch.distributed as dist

from distlab.chapters.ddp_overlap import powersgd_elements, step_bytes
from distlab.exercises.ddp_overlap import check_fp16_hook


def test_the_powersgd_formula_compresses_only_where_it_pays():
    # a vector (n x 1) is never compressed; a 4096 x 4096 matrix at rank 4 sends (4096 +
    # 4096) x 4
    assert powersgd_elements([(384,)], 4) == {"uncompressed": 384, "P": 0, "Q": 0}
    assert powersgd_elements([(4096, 4096)], 4) == {
        "uncompressed": 0,
        "P": 16384,
        "Q": 16384,
    }
    # (8 + 8) x 4 x 2 = 128 >= 64: not worth it at min_compression_rate 2, sent whole
    assert powersgd_elements([(8, 8)], 4) == {"uncompressed": 64, "P": 0, "Q": 0}
    # viewed as 8 x 8
    assert powersgd_elements([(8, 2, 4)], 4) == {"uncompressed": 64, "P": 0, "Q": 0}
    # 16 x 2 < 64: compressed
    assert powersgd_elements([(8, 2, 4)], 1) == {"uncompressed": 0, "P": 8, "Q": 8}


def test_step_bytes_adds_up_one_step_of_counted_all_reduces():
    # calls per step: (elements, dtype, bytes) per all-reduce
    run = {
        "calls": [[(10, torch.float32, 40)], [(3, torch.float32, 12), (5, None, 20)]]
    }
    assert step_bytes(run, 0) == 40
    assert step_bytes(run) == 32


def fp16_without_the_division(process_group, bucket):
    buffer = bucket.buffer()
    half = buffer.to(torch.float16)  # the sum, not the mean

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(half, async_op=True).get_future().then(decompress)


def test_the_checker_catches_a_hook_that_sums_instead_of_averaging():
    """The page runs the checker on its answer (it passes on every build); here, a
    wrong one."""
    with pytest.raises(AssertionError, match="did you divide by the world size"):
        check_fp16_hook(fp16_without_the_division)
