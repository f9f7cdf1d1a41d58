"""Each lab with ``--dtype bf16`` runs its matrix products in bf16, seen directly: a
forward hook on every ``nn.Linear`` notes its output's dtype (support/matmul_dtypes.py)
while the real script trains a step. The loss comparisons cannot see this on their
own: over a few steps a bf16 run's losses part from fp32's by some 1e-5
(tests/unit/test_compare.py). The GPU suite runs the same check on CUDA
(tests/gpu/test_gpu_paths.py). Lab 6's ``--fsdp`` needs 2 ranks: its FSDP2 policy is
checked by the Accelerate chapter and the GPU suite's lab 6 test."""

import pytest

from distlab.bench.lab_scripts import LABS as LAB_SCRIPTS
from support.matmul_dtypes import matmul_dtypes

LABS = tuple(LAB_SCRIPTS.values())  # lab1_single ... lab6_accelerate


@pytest.mark.parametrize("lab", LABS)
def test_bf16_runs_every_matmul_in_bf16(lab, tmp_path):
    assert matmul_dtypes(lab, tmp_path, "--dtype", "bf16") == ["torch.bfloat16"]


def test_the_check_sees_a_run_that_kept_fp32(tmp_path):
    """The bug class it guards: a precision policy dropped (here: not asked for) leaves
    every product in fp32, and the check says so."""
    assert matmul_dtypes("lab4_fsdp2", tmp_path, "--dtype", "fp32") == ["torch.float32"]
