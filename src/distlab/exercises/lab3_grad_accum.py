"""Lab 3's exercises, and the experiments behind the page and its answers.

    # gradient error of three loss normalisers, padded batches
    run_ranks(normaliser_errors, nprocs=2, args=(2,))
    # bucket all-reduces per micro-batch, and with forward/backward in or out of no_sync
    run_ranks(no_sync_counts, nprocs=2, args=(4,))
    # one process: a short run with the loss multiplied by 4
    losses_with_loss_scaled("adamw", 4, max_norm=0)
    # exercise 4's checker
    check_accumulates_by_tokens(accumulate)

Padded micro-batches are rows with different numbers of valid targets; every target
after a row's length is -100, ``F.cross_entropy``'s default ``ignore_index``, which the
GPT's loss uses, so ``model(x, y)`` returns the mean over the valid targets of its
rows only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.exercises._common import (
    on_ranks,
    passed,
    rank_device,
    relative_difference,
    require_callable,
)

IGNORE = -100  # F.cross_entropy's default ignore_index: a padded position, no target
ROWS = 2  # rows per micro-batch
SEED = 1
TINY_BLOCK = 64  # the tiny preset's block_size: the longest row


def padded_global_batch(
    rows: int, seed: int = SEED
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (rows, T) and their targets, row i valid for its first L_i
    positions only."""
    from distlab.data import token_data

    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, token_data().vocab_size, (rows, TINY_BLOCK + 1), generator=gen)
    x, y = x[:, :-1], x[:, 1:].clone()
    lengths = torch.randint(4, TINY_BLOCK + 1, (rows,), generator=gen)
    # the padding: no loss there
    y[torch.arange(TINY_BLOCK) >= lengths[:, None]] = IGNORE
    return x, y


def rank_micro_batches(x, y, rank: int, world_size: int, accum_steps: int) -> list:
    """This rank's rows of the global batch, as ``accum_steps`` micro-batches of
    ``ROWS`` rows."""
    mine = slice(rank * accum_steps * ROWS, (rank + 1) * accum_steps * ROWS)
    device = rank_device()
    return [
        (xm.to(device), ym.to(device))
        for xm, ym in zip(x[mine].split(ROWS), y[mine].split(ROWS))
    ]


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten().cpu() for p in model.parameters()])


def reference_gradient(x, y) -> torch.Tensor:
    """One process, the whole global batch: the gradient of the mean over every
    valid target."""
    from distlab.infra.experiment import gpt

    model = gpt("tiny", seed=SEED)
    _, loss = model(x, y)  # cross_entropy's mean skips the -100 targets
    loss.backward()
    return flat_grad(model)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum of the per-token losses over the valid targets (B, T) of ``logits`` (B,
    T, V)."""
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        targets.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )


@dataclass(frozen=True)
class TokenCounts:
    accum_steps: int  # micro-batches per rank, k
    world_size: int  # ranks, N
    rank_tokens: int  # valid targets in this rank's k micro-batches
    # valid targets in the whole global batch: every micro-batch of every rank
    global_tokens: int


# --- begin normalisers ---
def mean_of_means(logits, targets, counts: TokenCounts):
    """Lab 3's division: the micro-batch's mean over its own valid targets, divided
    by k."""
    return (
        token_loss_sum(logits, targets) / (targets != IGNORE).sum() / counts.accum_steps
    )


def rank_tokens(logits, targets, counts: TokenCounts):
    """The sum over the micro-batch, divided by this rank's count of valid targets."""
    return token_loss_sum(logits, targets) / counts.rank_tokens


def global_tokens(logits, targets, counts: TokenCounts):
    """The sum over the micro-batch, divided by the global count. DDP divides the summed
    gradients by N, so the loss is multiplied by N to leave sum / global count."""
    return token_loss_sum(logits, targets) * counts.world_size / counts.global_tokens


# --- end normalisers ---
NORMALISERS = {
    "mean_of_means": mean_of_means,
    "rank_tokens": rank_tokens,
    "global_tokens": global_tokens,
}


def count_tokens(micro_batches: list, world_size: int) -> TokenCounts:
    """The counts every normaliser may use; every rank must call it (it all-reduces)."""
    local = sum(int((y != IGNORE).sum()) for _, y in micro_batches)
    total = torch.tensor(local, device=rank_device())
    # one small all-reduce before the step: every rank's count, summed
    dist.all_reduce(total)
    return TokenCounts(len(micro_batches), world_size, local, int(total))


def fresh_ddp():
    """The tiny GPT in DDP on this rank's device, before its first step (so all its
    gradients in one bucket)."""
    from distlab.infra.experiment import gpt
    from distlab.parallel import apply_ddp

    return apply_ddp(gpt("tiny", seed=SEED).to(rank_device()), rank_device())


def accumulate_with(
    model, micro_batches: list, normaliser: Callable, counts: TokenCounts
) -> None:
    """Lab 3's accumulation, with ``normaliser`` in place of ``micro_loss /
    accum_steps``."""
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # forward AND backward inside
        with contextlib.nullcontext() if last else model.no_sync():
            logits, _ = model(x)
            normaliser(logits, y, counts).backward()


def normaliser_errors(accum_steps: int = 2) -> dict:
    """On each rank: the valid targets of its micro-batches, and for each normaliser the
    relative difference of the accumulated DDP gradient to the one-process reference."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = padded_global_batch(world_size * accum_steps * ROWS)
    micro_batches = rank_micro_batches(x, y, rank, world_size, accum_steps)
    counts = count_tokens(micro_batches, world_size)
    want = reference_gradient(x, y)
    errors = {}
    for name, normaliser in NORMALISERS.items():
        model = fresh_ddp()
        accumulate_with(model, micro_batches, normaliser, counts)
        errors[name] = relative_difference(flat_grad(model), want)
    tokens = [int((ym != IGNORE).sum()) for _, ym in micro_batches]
    return {"tokens": tokens, "global_tokens": counts.global_tokens, "errors": errors}


# --- begin counting hook ---
def count_bucket_allreduces(model) -> list:
    """A list that DDP's communication hook appends the bytes of each bucket it reduces
    to (then the default all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    reduced = []

    def counting_hook(group, bucket):
        reduced.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(group, bucket)

    model.register_comm_hook(dist.group.WORLD, counting_hook)
    return reduced


# --- end counting hook ---


# --- begin placements ---
def no_sync_placements() -> dict:
    """Bucket all-reduces in the backward of a first micro-batch whose forward,
    backward, both or neither ran inside ``no_sync()``; then in the backward of a last,
    synced micro-batch."""
    model = fresh_ddp()
    reduced = count_bucket_allreduces(model)
    x, _ = padded_global_batch(2 * ROWS)
    # two micro-batches of random tokens
    x = x.view(2, ROWS, TINY_BLOCK).to(rank_device())
    counts = {}
    for forward_in, backward_in in (
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    ):
        reduced.clear()
        with model.no_sync() if forward_in else contextlib.nullcontext():
            _, loss = model(x[0], x[0])
        with model.no_sync() if backward_in else contextlib.nullcontext():
            loss.backward()
        first = len(reduced)
        _, loss = model(x[1], x[1])  # the last micro-batch: outside, synced
        loss.backward()
        counts[(forward_in, backward_in)] = (first, len(reduced) - first)
        model.zero_grad(set_to_none=True)
    return counts


# --- end placements ---


def allreduces_per_micro_batch(accum_steps: int = 4) -> tuple[dict, float]:
    """Lab 3's step of ``accum_steps`` micro-batches, without and with ``no_sync()``
    (True): the bytes of each bucket DDP all-reduced in each micro-batch's backward,
    and the relative difference of the two gradients the step leaves."""
    x, _ = padded_global_batch(accum_steps * ROWS)
    x = x.view(accum_steps, ROWS, TINY_BLOCK).to(rank_device())
    per_micro, grads = {}, {}
    for use_no_sync in (False, True):
        model = fresh_ddp()
        reduced, per_micro[use_no_sync] = count_bucket_allreduces(model), []
        for i in range(accum_steps):
            skip = use_no_sync and i < accum_steps - 1  # the last one syncs
            with model.no_sync() if skip else contextlib.nullcontext():
                model(x[i], x[i])[1].backward()
            per_micro[use_no_sync].append(reduced[:])
            reduced.clear()
        grads[use_no_sync] = flat_grad(model)
    return per_micro, relative_difference(grads[True], grads[False])


def no_sync_counts(accum_steps: int = 4) -> tuple[dict, float, dict]:
    """The page's counts and the gradients' difference, from one launch of the ranks."""
    return (*allreduces_per_micro_batch(accum_steps), no_sync_placements())


# --- begin scaled loss ---
def losses_with_loss_scaled(
    optimizer: str, scale: float, max_norm: float = 0.0, steps: int = 12
) -> dict:
    """One process, the tiny GPT: ``steps`` steps with ``(loss * scale).backward()``, as
    a lab that forgot to divide by k = ``scale`` would take them. ``max_norm`` 0:
    no clipping."""
    from distlab.data import token_data
    from distlab.infra.experiment import gpt

    model = gpt("tiny", seed=SEED)
    if optimizer == "adamw":  # lab 3's AdamW, one parameter group
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1
        )
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    losses, clipped = [], 0
    threads = torch.get_num_threads()
    # matrices this small run faster on one thread: on the 2-core build machine, busy
    # with other jobs, 12 steps took 0.4-0.5 s on one thread and 4-8 s on two
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            x, y = token_data().batch("train", step, 8, TINY_BLOCK, SEED)
            _, loss = model(x, y)
            (loss * scale).backward()
            norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm or math.inf
            )
            clipped += bool(max_norm) and norm.item() > max_norm
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "clipped_steps": clipped}


# --- end scaled loss ---


MISTAKES = {
    "mean_of_means": (
        "each micro-batch's own mean divided by k (lab 3's division, right only for "
        "equal counts)"
    ),
    "rank_tokens": (
        "a division by this rank's count of valid targets, not the global count"
    ),
}


def _check_on_rank(accumulate: Callable, accum_steps: int) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = padded_global_batch(world_size * accum_steps * ROWS, seed=SEED + 1)
    micro_batches = rank_micro_batches(x, y, rank, world_size, accum_steps)
    want = reference_gradient(x, y)
    counts = count_tokens(micro_batches, world_size)
    # the gradients of the usual mistakes, to name the one the reader's equals
    wrong = {}
    for name in ("mean_of_means", "rank_tokens"):
        model = fresh_ddp()
        accumulate_with(model, micro_batches, NORMALISERS[name], counts)
        wrong[name] = relative_difference(flat_grad(model), want)
    model = fresh_ddp()
    reduced = count_bucket_allreduces(model)
    accumulate(model, [(xm.clone(), ym.clone()) for xm, ym in micro_batches])
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        return {"missing": sum(g is None for g in grads)}
    probe = fresh_ddp()
    probe_reduced = count_bucket_allreduces(probe)
    # one synced backward of a fresh model
    probe(micro_batches[0][0])[0].float().sum().backward()
    one_backward = len(probe_reduced)
    return {
        "error": relative_difference(flat_grad(model), want),
        "reduced": len(reduced),
        "one_backward": one_backward,
        "wrong": wrong,
        "global_tokens": counts.global_tokens,
    }


def check_accumulates_by_tokens(
    accumulate: Callable, nprocs: int = 2, accum_steps: int = 3
) -> None:
    """``accumulate(model, micro_batches)``, on every rank: ``model`` is the tiny GPT in
    DDP, ``micro_batches`` this rank's list of ``(x, y)`` with padded targets (-100). It
    must leave in every ``.grad`` the gradient of the mean loss over every valid target
    of the global batch (all micro-batches of all ranks), with one backward's worth of
    gradient all-reduces."""
    require_callable(
        accumulate, "accumulate", "def accumulate(model, micro_batches): ..."
    )
    results = on_ranks(
        functools.partial(_check_on_rank, accumulate, accum_steps),
        nprocs,
        "your accumulate",
    )
    for rank, result in enumerate(results):
        if "missing" in result:
            raise AssertionError(
                f"rank {rank}: {result['missing']} parameters have no .grad: "
                "did every backward run?"
            )
        if result["reduced"] == 0:
            raise AssertionError(
                f"rank {rank}: DDP all-reduced no gradient: the last "
                "micro-batch's forward and backward must run "
                "outside model.no_sync()"
            )
        if result["reduced"] > result["one_backward"]:
            raise AssertionError(
                f"rank {rank}: DDP reduced {result['reduced']} buckets, one "
                "backward's worth is "
                f"{result['one_backward']}: is every forward but the last "
                "inside model.no_sync()? (DDP decides "
                "in forward whether the next backward reduces)"
            )
        if result["error"] > 1e-5:
            match = min(
                result["wrong"],
                key=lambda name: abs(result["wrong"][name] - result["error"]),
            )
            same = abs(result["wrong"][match] - result["error"]) < 1e-6
            hint = f"; it is the gradient of {MISTAKES[match]}" if same else ""
            raise AssertionError(
                f"rank {rank}: your gradient differs from the one-process mean "
                f"over all {result['global_tokens']} "
                f"valid targets by {result['error']:.2e} relative{hint}"
            )
    passed(  # one line within the book's 88 columns
        f"the mean over all {results[0]['global_tokens']} valid targets (to "
        f"{max(r['error'] for r in results):.0e}), {results[0]['reduced']} "
        "all-reduce(s) a rank"
    )
