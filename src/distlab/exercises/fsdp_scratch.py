"""FSDP from scratch, exercises 3 and 4: SGD exposes a missing division; a bf16
gradient reduction."""

from __future__ import annotations

import functools
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

from distlab.chapters.fsdp_scratch import parameter_names, shard_grad
from distlab.chapters.fsdp_scratch import whole as full_gradients
from distlab.data import token_data
from distlab.exercises._common import on_ranks, passed, rank_device, relative_difference
from distlab.model import GPT, Block, GPTConfig, preset
from distlab.scratch.fsdp import FlatShardUnit, shard_model

ROWS_PER_RANK = 4
# relative: float rounding between N ranks and one process (the chapter measures ~1e-7)
AGREE = 1e-5
SEES = 1e-4  # relative: a comparison "sees" a difference ten times larger than rounding


def _require_unit_class(unit_class) -> None:
    if not (isinstance(unit_class, type) and issubclass(unit_class, FlatShardUnit)):
        raise ValueError(
            f"pass a subclass of distlab.scratch.fsdp.FlatShardUnit, got {unit_class!r}"
        )


def _shard_with(
    model: torch.nn.Module, unit_class: type, compute_dtype: torch.dtype | None = None
):
    return shard_model(
        model, {Block}, unit_class=unit_class, compute_dtype=compute_dtype
    )


def _batches(steps: int, n: int, cfg: GPTConfig) -> torch.Tensor:
    """(steps, 2, rows, T): x and y of every step. Random tokens: the comparison needs
    the same rows in every run, not Shakespeare."""
    # drawn on the CPU: the same numbers on any device
    gen = torch.Generator().manual_seed(0)
    return torch.randint(
        0, cfg.vocab_size, (steps, 2, ROWS_PER_RANK * n, cfg.block_size), generator=gen
    )


def _train(make_optimizer: Callable, unit_class: type | None, steps: int) -> dict:
    """The global mean loss of each step and the first step's gradient norm, training
    with ``unit_class`` on every rank; None is one process with the whole batch."""
    sharded = unit_class is not None
    rank, n = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    cfg = preset("tiny", vocab_size=token_data().vocab_size)
    model = GPT(cfg, seed=1).to(rank_device())
    fsdp = _shard_with(model, unit_class) if sharded else None
    optimizer = make_optimizer(model.parameters())
    losses, grad_norm = [], None
    for x, y in _batches(steps, dist.get_world_size(), cfg).to(rank_device()):
        mine = slice(rank * len(x) // n, (rank + 1) * len(x) // n)
        loss = model(x[mine], y[mine])[1]
        loss.backward()
        # the first step's gradient, reassembled from the shards
        if grad_norm is None and sharded:
            squares = sum(shard_grad(u).square().sum() for u in fsdp.units)
            dist.all_reduce(squares)
            grad_norm = squares.sqrt().item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        if sharded:
            dist.all_reduce(loss)
        losses.append(loss.item() / n)
    return {"losses": losses, "grad_norm": grad_norm}


def _three_runs(make_optimizer: Callable, summing_unit: type, steps: int) -> dict:
    return {
        "averaged": _train(make_optimizer, FlatShardUnit, steps),
        "summed": _train(make_optimizer, summing_unit, steps),
        "one process": _train(make_optimizer, None, steps),
    }


def _worst(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def check_sgd_exposes_missing_division(
    make_optimizer: Callable, summing_unit: type, steps: int = 3, nprocs: int = 2
) -> None:
    """Train the tiny GPT with ``make_optimizer(params)`` three ways: the chapter's unit
    (averages), ``summing_unit`` (the unit without the division by N) and one process.
    The averaging run must match one process, and the summing run must visibly not."""
    _require_unit_class(summing_unit)
    runs = on_ranks(
        functools.partial(_three_runs, make_optimizer, summing_unit, steps),
        nprocs,
        "training with your optimizer and unit",
    )[0]
    reference = runs["one process"]["losses"]
    averaged = _worst(runs["averaged"]["losses"], reference)
    if averaged > AGREE:
        raise AssertionError(
            "with your optimizer even the chapter's averaging unit differs "
            "from one process "
            f"by {averaged:.1e} relative (more than {AGREE:g}): does "
            "make_optimizer use the "
            "parameters it is given?"
        )
    ratio = runs["summed"]["grad_norm"] / runs["averaged"]["grad_norm"]
    if abs(ratio - nprocs) > 1e-3 * nprocs:
        hint = (
            "it still divides by N"
            if abs(ratio - 1) < 1e-3
            else f"without the division it should be {nprocs}"
        )
        raise AssertionError(
            f"your summing unit's first gradient is {ratio:.3f} times the "
            f"averaged one: {hint}"
        )
    summed = _worst(runs["summed"]["losses"], reference)
    if summed <= SEES:
        raise AssertionError(
            "with your optimizer, leaving out the division changes the losses "
            f"by only {summed:.1e} relative "
            f"(the runs agree to rounding, {AGREE:g}): the comparison cannot "
            "see the bug. An optimizer whose "
            "step does not depend on the gradient's scale (AdamW) hides it; "
            "take one whose step does"
        )
    passed(
        f"with your optimizer, averaging matches one process to {averaged:.1e} "
        f"relative over {steps} steps "
        f"on {nprocs} ranks (tolerance {AGREE:g}); leaving out the division "
        f"gives {ratio:.2f}x the gradient "
        f"and losses off by {summed:.1e} (more than {SEES:g}): the loss "
        "comparison now catches the bug"
    )


def _reduced_dtypes(calls: list) -> Callable:
    """``dist.reduce_scatter_single``, noting the dtype of every input it is given."""
    real = dist.reduce_scatter_single

    def reduce_scatter_single(output, input, *args, **kwargs):
        calls.append(input.dtype)
        return real(output, input, *args, **kwargs)

    return reduce_scatter_single


def _bf16_step_on_rank(unit_class: type) -> dict:
    """One forward and backward computing in bf16: FSDP2 reducing in bf16, the reader's
    unit, and the chapter's unit (which reduces in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = preset("tiny", vocab_size=token_data().vocab_size)
    x, y = _batches(1, n, cfg)[0].to(rank_device())
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    reference = GPT(cfg, seed=1).to(rank_device())
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
    )
    for block in reference.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(reference, mp_policy=policy)
    reference(x[mine], y[mine])[1].backward()
    want = {
        name: p.grad.full_tensor().cpu() for name, p in reference.named_parameters()
    }

    report, whole = {}, {}
    for who, cls in (("yours", unit_class), ("fp32 reduction", FlatShardUnit)):
        model, reduced = GPT(cfg, seed=1).to(rank_device()), []
        fsdp = _shard_with(model, cls, compute_dtype=torch.bfloat16)
        with mock.patch.object(dist, "reduce_scatter_single", _reduced_dtypes(reduced)):
            model(x[mine], y[mine])[1].backward()
        units, whole[who] = [], full_gradients(fsdp)
        for unit, unit_names in zip(fsdp.units, parameter_names(fsdp)):
            grads = {p.grad.dtype if p.grad is not None else None for p in unit.pieces}
            entry = {"unit": unit.name, "shard": unit.shard.dtype, "worst": None}
            entry["grad"] = None if None in grads else grads.pop()
            if entry["grad"] is not None:
                entry["worst"] = max(
                    (relative_difference(whole[who][name].cpu(), want[name]), name)
                    for name in unit_names
                )
            units.append(entry)
        report[who] = {"reduced": reduced, "units": units}
    # how far bf16 sums take the gradients from fp32 sums
    if len(whole["yours"]) == len(whole["fp32 reduction"]):
        report["vs fp32 reduction"] = max(
            relative_difference(g, whole["fp32 reduction"][k])
            for k, g in whole["yours"].items()
        )
    return report


def _check_report(
    report: dict, where: str, tolerance: float
) -> tuple[float, float, float]:
    """Raise on the first thing the reader's unit gets wrong; else the largest relative
    differences: the reader's gradients from FSDP2's bf16 reduction and from the
    chapter's fp32 reduction, and the fp32 reduction's from FSDP2's."""
    yours = report["yours"]
    if not yours["reduced"] or any(
        dtype != torch.bfloat16 for dtype in yours["reduced"]
    ):
        raise AssertionError(
            f"{where}: your unit reduce-scattered "
            f"{sorted(set(map(str, yours['reduced'])))} gradients; "
            "expected torch.bfloat16 only: give the reduce-scatter full.grad as "
            "it is (bf16), "
            "and cast only the reduced shard to fp32"
        )
    for u in yours["units"]:
        if u["shard"] != torch.float32:
            raise AssertionError(
                f"{where}, {u['unit']}: the shard is {u['shard']}; the shards "
                "stay float32"
            )
        if u["grad"] is None:
            raise AssertionError(
                f"{where}, {u['unit']}: the shard got no gradient; does "
                "_post_backward call self.accumulate(shard_grad)?"
            )
        if u["grad"] != torch.float32:
            raise AssertionError(
                f"{where}, {u['unit']}: the shard's gradient is {u['grad']}; it "
                "must be float32 (AdamW's state is fp32)"
            )
        diff, name = u["worst"]
        if diff > tolerance:
            raise AssertionError(
                f"{where}, {u['unit']}: the gradient of {name} differs from "
                "FSDP2's bf16 reduction by "
                f"{diff:.1e} relative (tolerance {tolerance:g}); a factor of N "
                "means a missing division"
            )
    fsdp2 = max(u["worst"][0] for u in report["fp32 reduction"]["units"])
    return (
        max(u["worst"][0] for u in yours["units"]),
        report["vs fp32 reduction"],
        fsdp2,
    )


def check_bf16_unit(
    unit_class: type, world_sizes: tuple[int, ...] = (2, 3), tolerance: float = 2e-2
) -> None:
    """``unit_class`` (a FlatShardUnit subclass), computing in bf16, must reduce-scatter
    its gradients in bf16 into fp32 shard gradients, like FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``."""
    _require_unit_class(unit_class)
    worst = [0.0, 0.0, 0.0]
    for n in world_sizes:
        reports = on_ranks(
            functools.partial(_bf16_step_on_rank, unit_class),
            n,
            "one step with your unit",
        )
        for rank, report in enumerate(reports):
            found = _check_report(report, f"on {n} ranks, rank {rank}", tolerance)
            worst = [max(a, b) for a, b in zip(worst, found)]
    passed(
        "your unit reduce-scatters in bfloat16 into float32 shard gradients, "
        f"on {' and '.join(map(str, world_sizes))} "
        "ranks. Its gradients differ from FSDP2's bf16 reduction by "
        f"{worst[0]:.1e} relative (tolerance "
        f"{tolerance:g}) and from the chapter's fp32 reduction by "
        f"{worst[1]:.1e}; the fp32 reduction differs from "
        f"FSDP2's by {worst[2]:.1e} (bf16's rounding unit is 2^-8 = 3.9e-03)"
    )
