"""One experiment harness: the GPT and its data, wrapped by strategy name, trained
and timed.

    # one process, the whole batch
    train("single", "tiny", steps=10)
    # on every rank, each on its rows
    run_ranks(train, nprocs=2, args=("ddp-bucketed",))

Every chapter and benchmark that compares ways of training runs them through ``train``:
the same model (``seed``), the same batches (``TokenData.batch`` by global step), fused
AdamW, the same loss reduction and the same timing rule, so two strategies differ only
by their wrapper. ``STRATEGIES`` is the one vocabulary of strategy names in the
repository; a chapter's extra measurement (phases, bytes, peaks) goes around ``train``,
through its ``trace`` list or its ``around_step`` hook.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.data import TokenData, token_data
from distlab.memory import state_bytes
from distlab.model import GPT, Block, preset
from distlab.parallel import apply_ddp, apply_fsdp
from distlab.runtime import DTYPES, dist_env, pick_device, rank_world, synchronize
from distlab.scratch.data_parallel import (
    ScratchDataParallel,
    SequentialDataParallel,
    replica_devices,
)
from distlab.scratch.ddp import BucketedDDP, HookDDP, NaiveDDP
from distlab.scratch.fsdp import shard_model

WARMUP_STEPS = 2  # steps not timed: the first ones warm up the allocator and caches


@dataclass(frozen=True)
class WrapOptions:
    """The knobs a wrapper may read; each strategy reads the ones it has."""

    # ddp, ddp-bucketed: gradient bucket size in MiB; None leaves the wrapper's default.
    # torch DDP keeps its small first bucket (1 MiB) only when bucket_cap_mb is NOT
    # passed: an explicit value, even the default 25, makes every bucket that size
    # (torch/nn/parallel/distributed.py)
    bucket_cap_mb: float | None = None
    replicas: int = 2  # dp-scratch*: replicas (the CPU n times, or GPUs 0..n-1)
    # dp-scratch*, fsdp-scratch*: filled with the step's timed pieces
    trace: list | None = None


@dataclass(frozen=True)
class Strategy:
    """How one named strategy wraps the model, and how the batch is split for it."""

    # model on device -> what to call
    wrap: Callable[[GPT, torch.device, WrapOptions], nn.Module]
    # one rank per process, each on its rows; False: the whole batch here
    distributed: bool
    about: str  # what it is, in a few words
    # torch threads for the run; None: as the process has them
    intra_op_threads: int | None = None


def _scratch_dp(cls: type):
    def wrap(model, device, options):
        wrapped = cls(model, replica_devices(device, options.replicas))
        wrapped.trace = options.trace
        return wrapped

    return wrap


def _bucket_kwargs(options: WrapOptions) -> dict:
    """``bucket_cap_mb`` only if it was set: passing the default is not the default."""
    return (
        {}
        if options.bucket_cap_mb is None
        else {"bucket_cap_mb": options.bucket_cap_mb}
    )


def _scratch_ddp(cls: type):
    def wrap(model, device, options):
        return (
            cls(model, **_bucket_kwargs(options)) if cls is BucketedDDP else cls(model)
        )

    return wrap


def _scratch_fsdp(reshard_after_forward: bool):
    def wrap(model, device, options):
        # in place: the model is what to call; each Block is a unit, as in apply_fsdp
        shard_model(
            model,
            {Block},
            reshard_after_forward=reshard_after_forward,
            trace=options.trace,
        )
        return model

    return wrap


def shard_hybrid(model: GPT, device: torch.device, options: WrapOptions) -> nn.Module:
    """HSDP: shard inside groups of 2 ranks, replicate across the groups (a
    2-D mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    n = dist.get_world_size()
    if n % 2:
        raise ValueError(
            f"hsdp shards over groups of 2 ranks; {n} ranks do not split into them"
        )
    mesh = init_device_mesh(
        device.type, (n // 2, 2), mesh_dim_names=("replicate", "shard")
    )
    return apply_fsdp(model, mesh=mesh)


# the one vocabulary, lowercase and hyphenated: recorded results use these names, and
# the labs' summary.json "strategy" is one of them plus its features
# ("ddp+accumulation")
STRATEGIES: dict[str, Strategy] = {
    "single": Strategy(lambda m, d, o: m, False, "one process, no wrapper"),
    "ddp": Strategy(
        lambda m, d, o: apply_ddp(m, d, **_bucket_kwargs(o)), True, "torch DDP"
    ),
    "ddp-naive": Strategy(
        _scratch_ddp(NaiveDDP), True, "DDP from scratch: all-reduce after backward"
    ),
    "ddp-hooks": Strategy(
        _scratch_ddp(HookDDP), True, "DDP from scratch: a hook per parameter"
    ),
    "ddp-bucketed": Strategy(
        _scratch_ddp(BucketedDDP), True, "DDP from scratch: async buckets"
    ),
    "dp": Strategy(
        lambda m, d, o: nn.DataParallel(m),
        False,
        "nn.DataParallel (on a CPU: the module alone)",
    ),
    "dp-scratch": Strategy(
        _scratch_dp(ScratchDataParallel),
        False,
        "DataParallel from scratch: a thread each",
    ),
    "dp-scratch-1-intra-op": Strategy(
        _scratch_dp(ScratchDataParallel),
        False,
        "dp-scratch with 1 intra-op thread",
        intra_op_threads=1,
    ),
    "dp-scratch-no-threads": Strategy(
        _scratch_dp(SequentialDataParallel),
        False,
        "dp-scratch's replicas one after the other",
    ),
    "fsdp2": Strategy(lambda m, d, o: apply_fsdp(m), True, "torch FSDP2 (fully_shard)"),
    "fsdp2-no-reshard": Strategy(
        lambda m, d, o: apply_fsdp(m, reshard_after_forward=False),
        True,
        "FSDP2, blocks kept gathered to backward",
    ),
    "fsdp2-bf16": Strategy(
        lambda m, d, o: apply_fsdp(m, param_dtype=DTYPES["bf16"]),
        True,
        "FSDP2 computing in bf16, fp32 shards",
    ),
    "hsdp": Strategy(shard_hybrid, True, "FSDP2 on a (replicate, shard) mesh"),
    "fsdp-scratch": Strategy(
        _scratch_fsdp(True), True, "FSDP from scratch (flat shards)"
    ),
    "fsdp-scratch-no-reshard": Strategy(
        _scratch_fsdp(False), True, "fsdp-scratch, blocks kept gathered"
    ),
}


def strategy(name: str) -> Strategy:
    """The strategy called ``name``; a ValueError listing the names for any other."""
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` intra-op threads (None: leave the setting alone)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gpt(preset_name: str = "tiny", seed: int = 1337) -> GPT:
    """The preset's GPT on the CPU, with the vocabulary of the data every
    experiment uses."""
    return GPT(preset(preset_name, vocab_size=token_data().vocab_size), seed=seed)


@dataclass
class Experiment:
    """One strategy's model, optimizer and data on this rank, ready to step."""

    strategy: str
    model: GPT  # the GPT itself; under FSDP its parameters are this rank's shards
    wrapped: nn.Module  # what to call: the model under the strategy's wrapper
    optimizer: torch.optim.Optimizer
    data: TokenData
    device: torch.device
    # rank 0 of world size 1 for a strategy that is not distributed: the whole
    # batch here
    rank: int
    world_size: int
    global_batch: int
    seed: int

    def loss(self, step: int) -> torch.Tensor:
        """The mean loss of this rank's rows of global batch ``step`` (a scalar)."""
        T = self.model.config.block_size
        x, y = self.data.batch(
            "train",
            step,
            self.global_batch,
            T,
            self.seed,
            self.rank,
            self.world_size,
            self.device,
        )
        loss = self.wrapped(x, y)[1]
        # DataParallel gathers one loss per replica; a scalar stays itself
        return loss.mean()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward, then whatever gradient sync the wrapper leaves to be finished."""
        loss.backward()
        if hasattr(self.wrapped, "finish_gradient_sync"):  # the from-scratch DDPs
            self.wrapped.finish_gradient_sync()


def build(
    strategy_name: str,
    preset_name: str = "tiny",
    global_batch: int = 16,
    seed: int = 1337,
    lr: float = 1e-3,
    options: WrapOptions | None = None,
) -> Experiment:
    """The GPT on this rank's device (every rank the same weights), wrapped, with
    fused AdamW."""
    how = strategy(strategy_name)
    if how.distributed and not dist.is_initialized():
        raise RuntimeError(
            f"strategy {strategy_name!r} runs on every rank of a process group: "
            "start it with distlab.infra.launch.run_ranks or torchrun"
        )
    rank, world_size = rank_world() if how.distributed else (0, 1)
    if global_batch < 1 or global_batch % world_size:
        raise ValueError(
            f"global batch {global_batch} does not split over {world_size} ranks"
        )
    device = pick_device("auto", dist_env()[1])
    # move first, wrap second: wrappers hook the moved tensors
    model = gpt(preset_name, seed).to(device)
    wrapped = how.wrap(model, device, options or WrapOptions())
    # the optimizer sees model.parameters() after wrapping: under FSDP, the shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return Experiment(
        strategy_name,
        model,
        wrapped,
        optimizer,
        token_data(),
        device,
        rank,
        world_size,
        global_batch,
        seed,
    )


def train(
    strategy_name: str,
    preset_name: str = "tiny",
    steps: int = 10,
    global_batch: int = 16,
    seed: int = 1337,
    lr: float = 1e-3,
    options: WrapOptions | None = None,
    around_step: Callable[[Experiment, int], contextlib.AbstractContextManager]
    | None = None,
) -> dict:
    """``steps`` AdamW steps under ``strategy_name`` on this rank; plain data back
    (picklable).

    Returns the global mean loss of every step (the same on every rank), every step's
    seconds, tokens/s over the steps after ``WARMUP_STEPS`` (None when there are none),
    this rank's bytes of parameters, gradients and AdamW state right after the first
    optimizer step (AdamW allocates its state then), and ``last_step``: when its
    forward, backward and optimizer phases began and ended (``time.perf_counter`` of
    this process). ``options.trace`` holds the last step's pieces from the wrappers that
    record them. ``around_step(experiment, step)``: a context around each step's
    forward, backward and optimizer step (the gradients are still there when it exits),
    for a chapter's own measurements; it runs inside the timed step.
    """
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    options = options or WrapOptions()
    with intra_op_threads(strategy(strategy_name).intra_op_threads):
        exp = build(strategy_name, preset_name, global_batch, seed, lr, options)
        threads = torch.get_num_threads()
        losses, seconds, first_state, last_step = [], [], None, {}
        for step in range(steps):
            if options.trace is not None:
                options.trace.clear()  # it keeps the last step's pieces only
            synchronize(exp.device)
            # --- begin step ---
            start = time.perf_counter()
            with around_step(exp, step) if around_step else contextlib.nullcontext():
                loss = exp.loss(step)
                backward_start = time.perf_counter()
                exp.backward(loss)
                optimizer_start = time.perf_counter()
                exp.optimizer.step()
            if first_state is None:
                # gradients and AdamW state exist now
                first_state = state_bytes(exp.model, exp.optimizer)
            exp.optimizer.zero_grad(set_to_none=True)
            synchronize(exp.device)
            end = time.perf_counter()
            total = loss.detach().float().clone()
            if exp.world_size > 1:
                # SUM of the ranks' means, then / N: right on every backend ...
                dist.all_reduce(total)
            # ... over N: the global batch's mean
            losses.append(total.item() / exp.world_size)
            # --- end step ---
            seconds.append(time.perf_counter() - start)
            last_step = {
                "start": start,
                "forward": (start, backward_start),
                "backward": (backward_start, optimizer_start),
                "optimizer": (optimizer_start, end),
            }
    timed = seconds[WARMUP_STEPS:]
    tokens = global_batch * exp.model.config.block_size
    return {
        "strategy": strategy_name,
        "world_size": exp.world_size,
        "threads": threads,
        "losses": losses,
        "step_s": seconds,
        "tokens_per_s": tokens * len(timed) / sum(timed) if timed else None,
        "state_bytes": first_state,
        "last_step": last_step,
    }
