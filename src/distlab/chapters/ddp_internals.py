"""The DDP chapter's experiments: each data-parallel wrapper trained on equal terms, and the
gradients each one leaves after the sync.

Called on every rank (through ``distlab.infra.launch.run_ranks``) or in a single process:

    run_ranks(train_steps, nprocs=2, args=("ddp-bucketed",))   # from-scratch DDP on 2 ranks
    train_steps("single")                                      # the one-process reference

Strategies (``STRATEGIES``, names from ``distlab.infra.experiment``): ``single`` (no wrapper;
one process), ``ddp`` (torch's DistributedDataParallel) and the from-scratch ``ddp-naive``,
``ddp-hooks`` and ``ddp-bucketed`` of ``distlab.scratch.ddp``.
"""

from __future__ import annotations

import torch

from distlab.infra.experiment import WrapOptions, build, train

FROM_SCRATCH = ("ddp-naive", "ddp-hooks", "ddp-bucketed")
STRATEGIES = ("single", "ddp", *FROM_SCRATCH)


def train_steps(
    strategy: str,
    preset_name: str = "tiny",
    steps: int = 10,
    global_batch: int = 16,
    seed: int = 1337,
    bucket_cap_mb: float = 25.0,
    lr: float = 1e-3,
) -> dict:
    """``steps`` AdamW steps; the global mean loss of each step, its seconds and tokens/s."""
    return train(strategy, preset_name, steps, global_batch, seed, lr, options=WrapOptions(bucket_cap_mb=bucket_cap_mb))


def gradients(
    strategy: str, preset_name: str = "tiny", global_batch: int = 16, seed: int = 1337, bucket_cap_mb: float = 25.0
) -> list[torch.Tensor]:
    """Every parameter's gradient after one forward/backward and the gradient sync."""
    exp = build(strategy, preset_name, global_batch, seed, options=WrapOptions(bucket_cap_mb=bucket_cap_mb))
    exp.backward(exp.loss(0))
    return [p.grad.detach().cpu().clone() for p in exp.model.parameters()]
