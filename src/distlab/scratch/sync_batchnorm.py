"""SyncBatchNorm rebuilt for CPU tensors on gloo: torch's own refuses them (its forward
raises for a CPU input, and DDP refuses a CPU module that holds one), and its kernels
(``batch_norm_stats``, ``batch_norm_elemt``, ...) exist for GPUs only.

    model = convert_sync_batchnorm_on_gloo(model)   # every BatchNorm layer, in place
    model = convert_sync_batchnorm_on_gloo(model, process_group=group)  # per group

The arithmetic and the collectives follow torch's ``SyncBatchNorm`` autograd function
(torch/nn/modules/_functions.py in torch 2.13): one all-gather of each rank's
per-channel statistics and row count in forward, one all-reduce of two per-channel
sums in backward. torch's kernel gathers (mean, invstd, count), with invstd =
1/sqrt(var + eps), and turns invstd back into a variance to combine them; this one
gathers (mean, var, count): the same 2C+1 numbers, without the round trip.
book/ddp_in_practice.md checks it against one process with the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class _SyncBatchNormOnGloo(torch.autograd.Function):
    """torch's SyncBatchNorm function (torch/nn/modules/_functions.py) with its
    CUDA-only kernels (``batch_norm_stats``, ``batch_norm_elemt``, ...) written as plain
    tensor ops; the same collectives: one all-gather in forward, one all-reduce
    in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        dims, shape, channels = (
            [0, *range(2, x.dim())],
            [1, x.size(1)] + [1] * (x.dim() - 2),
            x.size(1),
        )
        # (2C+1,)
        local = torch.cat(
            [
                x.mean(dims),
                x.var(dims, unbiased=False),
                x.new_tensor([x.numel() // channels]),
            ]
        )
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        # counts may differ by rank: gather, not a plain sum
        dist.all_gather(gathered, local, group=group)
        # (N, C), (N, C), (N, 1)
        means, variances, counts = torch.stack(gathered).split(
            [channels, channels, 1], dim=1
        )
        n = counts.sum()
        mean = (counts * means).sum(0) / n
        # the variance of the union of the shards
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / n
        running_mean.lerp_(mean, momentum)
        # unbiased, as nn.BatchNorm's running_var
        running_var.lerp_(var * n / (n - 1), momentum)
        invstd = (var + eps).rsqrt()
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd, n)
        ctx.dims, ctx.shape, ctx.group = dims, shape, group
        return xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd, n = ctx.saved_tensors
        sum_dy, sum_dy_xhat = dy.sum(ctx.dims), (dy * xhat).sum(ctx.dims)
        # this rank's: DDP averages them
        grad_weight, grad_bias = sum_dy_xhat.clone(), sum_dy.clone()
        both = torch.cat([sum_dy, sum_dy_xhat])
        # the input's gradient needs the sums over every rank's rows
        dist.all_reduce(both, group=ctx.group)
        sum_dy, sum_dy_xhat = both.split(len(sum_dy))
        grad_x = (
            dy - sum_dy.view(ctx.shape) / n - xhat * sum_dy_xhat.view(ctx.shape) / n
        ) * (invstd * weight).view(ctx.shape)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNormOnGloo(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm layer normalised with the statistics of every rank's rows, on CPU
    tensors over gloo. Not an ``nn.SyncBatchNorm`` subclass: DDP refuses those in a
    CPU module. ``process_group``: the ranks whose rows are normalised together (all
    of them when None), as torch's."""

    process_group = None

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected (B, C, ...) input, got {x.dim()}-D")

    def forward(self, x):
        group = self.process_group if self.process_group else dist.group.WORLD
        if not (
            self.training and dist.is_initialized() and dist.get_world_size(group) > 1
        ):
            return super().forward(x)
        self.num_batches_tracked.add_(1)
        return _SyncBatchNormOnGloo.apply(
            x,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            self.momentum,
            group,
        )


def convert_sync_batchnorm_on_gloo(model: nn.Module, process_group=None) -> nn.Module:
    """What ``nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)`` does, to
    ``SyncBatchNormOnGloo``: every BatchNorm layer, in place, keeping its weights and
    running statistics."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.__class__ = SyncBatchNormOnGloo
            module.process_group = process_group
    return model


def torch_refusals() -> dict[str, str]:
    """What torch's own SyncBatchNorm does with CPU tensors on a gloo group: each
    attempt, one line."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    )
    out = {"converted": type(model[1]).__name__}
    for name, attempt in (
        ("forward", lambda: model(torch.randn(4, 4))),
        ("DDP(model)", lambda: DDP(model)),
    ):
        try:
            attempt()
            out[name] = "ran"
        except ValueError as err:
            out[name] = f"ValueError: {err}"
    return out
