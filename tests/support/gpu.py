"""What the GPU tests (tests/gpu/, ``pytest -m gpu``) share: the GPUs there are, the
marks that skip them without CUDA, the tolerances they hold the labs to, and a lab run
on the GPUs.

Tolerances against lab 1, relative, per step's loss (the CPU tests hold every lab
to 1e-5):

- fp32, ``FP32_RTOL`` 1e-4. TF32 stays off (the labs' default; no ``--tf32``), so every
  matmul is a true fp32 one, but a GPU run is not bit-for-bit lab 1: NCCL sums the
  ranks' gradients in an order of its own, cuBLAS picks other kernels (some split the
  sum over K) for other per-rank shapes, and some CUDA kernels add in an order that can
  change from run to run (the docstring of ``torch.use_deterministic_algorithms``,
  torch/__init__.py, lists them: ``NLLLoss``, under the model's cross-entropy, is one).
  Each is a rounding difference, and 10x the CPU tests' bound leaves room for them to
  add up over the steps.
- bf16, ``BF16_RTOL`` 5e-3, against lab 1 in bf16. bf16 keeps 8 significant bits
  (rounding moves a value by up to 2^-8, 0.4%, relative), and the labs round different
  tensors: labs 1-3 and 6 autocast, labs 4-5 (and 6 with ``--fsdp``) cast the parameters
  through FSDP2's policy. So wide a bound cannot tell bf16 from fp32 on its own (on the
  CPU a bf16 run's losses stay within 1e-4 of fp32's over these steps): each bf16 case
  must also part from fp32 (``support.compare.computed_in_low_precision``), and
  tests/gpu/test_gpu_paths.py sees the dtype of every matrix product directly.

Every comparison also holds the gradient norms past the warm-up
(``support.compare.mismatches``): a gradient N times too large leaves the losses alone.

First choices, made without a GPU at hand. The fp32 and bf16 loss bounds held on one
H100 (torch 2.11.0+cu130, 2026-11-24) over the first 10 steps: labs 1-6 on one GPU, and
lab 1 compiled. The gradient-norm comparison past the warm-up, the memory and compile
tests of test_gpu_paths.py and every case that needs two or more GPUs have not run on
GPUs yet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distlab.infra.launch import run_script
from distlab.metrics import read_metrics
from support.labs import BASELINE, BASELINE_LOSSES, baseline_args

FP32_RTOL, BF16_RTOL = 1e-4, 5e-3
RTOL = {"fp32": FP32_RTOL, "bf16": BF16_RTOL}
# the baseline's steps: a short warm-up, then a constant learning rate (its --min-lr is
# its --lr), so that a shorter run is a prefix of it; the gradient norms are compared
# past the warm-up (support.compare: a gradient N times too large hides in the losses)
WARMUP, STEPS = BASELINE["warmup_steps"], len(BASELINE_LOSSES)
GLOBAL_BATCH = 16  # the baseline's
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# "every GPU of the machine": all of them, or the most that split the global
# batch evenly
ALL_GPUS = max((n for n in range(1, GPUS + 1) if GLOBAL_BATCH % n == 0), default=0)

NO_CUDA = (
    "needs a CUDA GPU: torch.cuda.is_available() is False here (no NVIDIA GPU, "
    "a CPU-only torch, "
    'or CUDA_VISIBLE_DEVICES="" hiding the GPUs)'
)
# a GPU test module's pytestmark
GPU_MODULE = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)]
MULTI_GPU = pytest.mark.skipif(
    ALL_GPUS < 2, reason=f"needs 2 or more CUDA GPUs; this machine shows {GPUS}"
)


def micro_batch(nprocs: int) -> int:
    """Labs 3-6's micro-batch: 2 per rank and step, so accumulation runs, as far as the
    batch splits."""
    return max(1, GLOBAL_BATCH // (2 * nprocs))


def lab_losses(
    lab: str, out: Path, nprocs: int, *extra, device: str = "cuda", steps: int = STEPS
) -> list[float]:
    """Run ``src/labs/<lab>.py`` on ``nprocs`` ranks of ``device`` (one GPU each on
    CUDA) and return its losses, step by step. A rank that fails raises ``RankFailed``
    with its error."""
    records = lab_records(lab, out, nprocs, *extra, device=device, steps=steps)
    return [m["loss"] for m in records]


def lab_records(
    lab: str,
    out: Path,
    nprocs: int,
    *extra,
    device: str = "cuda",
    steps: int = STEPS,
    micro_batch_size: int | None = None,
) -> list[dict]:
    """``lab_losses``'s run, and its records (step, loss, grad_norm, ...). ``extra``
    options override the baseline's; labs 3-6 get ``micro_batch_size`` (default:
    ``micro_batch(nprocs)``)."""
    args = [*baseline_args(steps), "--device", device, "--out", out, *extra]
    if lab not in ("lab1_single", "lab2_ddp"):
        args += ["--micro-batch-size", micro_batch_size or micro_batch(nprocs)]
    run_script(
        f"src/labs/{lab}.py",
        args,
        nprocs=nprocs,
        device=device,
        timeout=600,
        quiet=True,
    )
    return read_metrics(out)
