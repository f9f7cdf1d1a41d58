"""Small models that break data-parallel code written for one model, the data each rank
(or replica) gets, and the one-process reference the wrappers are checked against.

    EDGE_MODELS        name -> class: frozen, unused, data-dependent, tied, batchnorm
    shard(r, n, step)  the rows of rank (or replica) r of n at a step
    reference(name, n) one process, no wrapper: per step, the gradients of the mean
                       over the n shards of each shard's mean loss, then an SGD step
    train_wrapped(...) the same steps under a wrapper, on one rank of a process group

The reference runs each shard through the model separately, because that is what data
parallelism computes: for models whose rows are independent it equals one forward of the
whole batch, and for the others (BatchNorm normalises with its batch's statistics; a
branch taken by the batch as a whole) the per-shard version is the meaning DDP
gives them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

WIDTH, ROWS, LR = 4, 6, 0.1


class Frozen(nn.Module):
    """The first layer's weight is frozen (``requires_grad=False``); its bias
    still trains."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, 8), nn.Linear(8, WIDTH)
        self.first.weight.requires_grad_(False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class UnusedBranch(nn.Module):
    """``spare`` takes part in no forward: no rank ever gets a gradient for it."""

    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.used(x)


class DataDependentBranch(nn.Module):
    """``extra`` runs only for a batch with a positive mean: on some ranks and not
    on others."""

    def __init__(self):
        super().__init__()
        self.main, self.extra = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        out = self.main(x)
        return out + self.extra(torch.tanh(x)) if x.mean() > 0 else out


class Tied(nn.Module):
    """One matrix in two modules, as a GPT ties its embedding and its head."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.decode.weight = self.encode.weight  # model.parameters() yields it once

    def forward(self, x):
        return self.decode(torch.tanh(self.encode(x)))


class WithBatchNorm(nn.Module):
    """BatchNorm: buffers (running statistics) that every training forward updates
    in place."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WIDTH, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, WIDTH)
        )

    def forward(self, x):
        return self.net(x)


EDGE_MODELS: dict[str, type[nn.Module]] = {
    "frozen": Frozen,
    "unused": UnusedBranch,
    "data-dependent": DataDependentBranch,
    "tied": Tied,
    "batchnorm": WithBatchNorm,
}
# torch DDP needs find_unused_parameters=True
NEEDS_UNUSED_SEARCH = {"unused", "data-dependent"}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return EDGE_MODELS[name]()


def shard(rank: int, world_size: int, step: int) -> torch.Tensor:
    """ROWS rows; even ranks get a positive batch and odd ranks a negative one, so the
    data-dependent branch runs on some ranks only (whenever there are 2 or more)."""
    rows = torch.randn(
        ROWS,
        WIDTH,
        generator=torch.Generator().manual_seed(1000 * step + 10 * world_size + rank),
    )
    return rows.abs() if rank % 2 == 0 else -rows.abs()


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [
        None if p.grad is None else p.grad.detach().clone() for p in model.parameters()
    ]


def sgd_step(model: nn.Module) -> None:
    # plain SGD: torch.optim's first step imports torch._dynamo (seconds)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(LR * p.grad)


def state(model: nn.Module) -> dict:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
    }


def one_process_steps(model, batch, world_size: int, steps: int, grads_of=grads):
    """One process, no wrapper: per step, the gradients of the mean of the ranks' mean
    losses (``batch(rank, step)`` is a rank's rows; None where no rank's rows reached
    a parameter), then an SGD step. Returns each step's ``grads_of(model)``."""
    per_step = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        losses = [loss_of(model(batch(r, step))) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        per_step.append(grads_of(model))
        sgd_step(model)
    return per_step


def reference(name: str, world_size: int, steps: int = 3) -> dict:
    """One process, no wrapper: each step's gradients (None where no shard reached
    a parameter)."""
    model = build(name)
    per_step = one_process_steps(
        model, lambda rank, step: shard(rank, world_size, step), world_size, steps
    )
    return {"grads": per_step, **state(model)}


def train_wrapped(
    wrap: Callable[[nn.Module], nn.Module],
    name: str,
    steps: int = 3,
    backwards_per_step: int = 1,
) -> dict:
    """On one rank: ``steps`` steps of ``wrap(model)``; the gradients after each sync,
    then the final parameters and buffers. Ranks other than 0 start from different
    values (parameters, frozen ones included, and buffers), so the wrapper must
    broadcast rank 0's."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build(name)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.add_(rank)
    wrapped = wrap(model)
    per_step = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)  # what every lab does
        for _ in range(backwards_per_step):
            loss_of(wrapped(shard(rank, world_size, step))).backward()
        if hasattr(wrapped, "finish_gradient_sync"):  # the from-scratch wrappers
            wrapped.finish_gradient_sync()
        per_step.append(grads(model))
        sgd_step(model)
    return {"grads": per_step, **state(model)}


def assert_same_grads(
    got: list, expected: list, atol: float = 1e-6, what: str = ""
) -> None:
    """Step by step: None in the same places, and the tensors equal to rounding."""
    for step, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert [g is None for g in mine] == [g is None for g in theirs], (
            f"{what} step {step}: None pattern"
        )
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a is not None:
                torch.testing.assert_close(
                    a, b, rtol=1e-5, atol=atol, msg=f"{what} step {step} parameter {i}"
                )


# ---- more models for the from-scratch FSDP (test_fsdp_scratch_models.py)
class ConvBN(nn.Module):
    """A convolution, BatchNorm (running statistics: buffers, not sharded) and ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    """(B, 3, 6, 6) -> (B, WIDTH): a stem, two ConvBN blocks, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(ConvBN(8), ConvBN(8))
        self.head = nn.Linear(8, WIDTH)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class Twice(nn.Module):
    """A block called twice in one forward: its parameters get two uses' gradients."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.out(self.block(self.block(x)))


class FrozenAndUnused(nn.Module):
    """In one module: a frozen weight (its bias trains), an unused layer and a scale
    that a sharding wrapper may be told to ignore."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, 8), nn.Linear(8, WIDTH)
        self.spare = nn.Linear(WIDTH, WIDTH)  # takes part in no forward
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.first.weight.requires_grad_(False)

    def forward(self, x):
        return self.scale * self.second(torch.tanh(self.first(x)))
