"""The float8 benchmark's guards, on any machine: which layers it converts, and the
one-line error it gives where float8 cannot run (no GPU, an older GPU, no torchao). The
run itself is a GPU test (tests/gpu/test_gpu_float8.py)."""

from unittest import mock

import pytest
import torch.nn as nn

from distlab.bench import float8
from distlab.errors import UserError


def test_only_linears_whose_two_dims_divide_by_16_are_converted():
    assert float8.float8_able(nn.Linear(768, 3072), "blocks.0.mlp.fc")
    # the 65-character head
    assert not float8.float8_able(nn.Linear(768, 65), "lm_head")
    assert not float8.float8_able(nn.LayerNorm(768), "ln_f")


def test_without_a_gpu_it_says_why_in_one_line():
    with mock.patch("torch.cuda.is_available", return_value=False):
        with pytest.raises(UserError, match="needs a CUDA GPU"):
            float8.require_float8_gpu()


def test_an_ampere_gpu_is_refused_by_its_compute_capability():
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)),
    ):
        with pytest.raises(UserError, match=r"8\.9\+; this GPU has \(8, 0\)"):
            float8.require_float8_gpu()
