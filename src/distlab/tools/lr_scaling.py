"""Learning-rate rules for a global batch that grows with the ranks, and a run that
compares them (book/ddp_tuning.md's second half).

At a fixed per-rank batch B, N ranks train on a global batch of N x B. Every world size
here gets the same token budget (``TOKENS_AT_ONE_RANK_STEPS`` steps of one rank's
batch), so N ranks take 1/N as many steps, and each runs every learning-rate rule of
``RULES`` one after the other in one launch:

    # 4 ranks: every rule, same tokens as 1 rank's run
    run_ranks(scaling_runs, nprocs=4)
    # 1 process (the "single" strategy: no wrapper)
    scaling_runs()

The models, batches and AdamW are ``distlab.infra.experiment``'s, so N ranks at batch B
see exactly the windows of one process at batch N x B (``TokenData.batch`` draws by
global step), which is what ``one_process_losses`` checks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distlab.infra.experiment import build
from distlab.runtime import rank_world

# windows of 64 tokens per rank per step, the same at every world size
PER_RANK_BATCH = 8
BASE_LR = 1e-3  # AdamW's learning rate at one rank (the tiny model's usual 1e-3)
# steps of one rank: the token budget every world size gets
TOKENS_AT_ONE_RANK_STEPS = 48
WARMUP_FRACTION = 0.25  # of a run's steps, for the rules with warm-up
VAL_WINDOWS = 64  # windows of the validation batch every run is scored on at its end

# --- begin rules ---
# name -> (the factor on BASE_LR at N ranks, whether the LR warms up linearly
# from BASE_LR/steps)
RULES: dict[str, tuple] = {
    "unscaled": (lambda n: 1.0, False),
    # Goyal et al. 2017, for SGD: without its warm-up, then with it
    "linear": (lambda n: float(n), False),
    "linear + warm-up": (lambda n: float(n), True),
    # the square-root rule, for Adam-like optimizers
    "sqrt + warm-up": (lambda n: math.sqrt(n), True),
}


def learning_rate(rule: str, world_size: int, step: int, steps: int) -> float:
    """The rule's learning rate at ``step`` of ``steps`` on ``world_size`` ranks."""
    scale, warm = RULES[rule]
    peak = BASE_LR * scale(world_size)
    warmup_steps = max(1, round(WARMUP_FRACTION * steps)) if warm else 0
    return peak * min(1.0, (step + 1) / warmup_steps) if warm else peak


# --- end rules ---


def _global_mean(loss: torch.Tensor, world_size: int) -> float:
    total = loss.detach().clone()
    if world_size > 1:
        # the ranks' mean losses, summed, over N: the global batch's mean
        dist.all_reduce(total)
    return total.item() / world_size


@torch.no_grad()
def val_loss(exp) -> float:
    """The mean loss on one fixed batch of VAL_WINDOWS validation windows (the whole
    batch on every rank: the replicas are equal, so every rank gets the same number)."""
    T = exp.model.config.block_size
    x, y = exp.data.global_windows("val", 0, VAL_WINDOWS, T, exp.seed)
    return exp.model(x.to(exp.device), y.to(exp.device))[1].item()


def train_with_rule(rule: str, steps: int, global_batch: int) -> dict:
    """``steps`` AdamW steps at ``global_batch`` under the rule's learning rate; on
    every rank, or in one process when no group is initialised. Global mean loss per
    step, the final validation loss and the learning rates used."""
    world_size = rank_world()[1]
    exp = build(
        "ddp" if world_size > 1 else "single", global_batch=global_batch, lr=BASE_LR
    )
    losses, rates = [], []
    for step in range(steps):
        rate = learning_rate(rule, world_size, step, steps)
        for group in exp.optimizer.param_groups:
            group["lr"] = rate
        loss = exp.loss(step)
        exp.backward(loss)
        exp.optimizer.step()
        exp.optimizer.zero_grad(set_to_none=True)
        losses.append(_global_mean(loss, world_size))
        rates.append(rate)
    return {"losses": losses, "val_loss": val_loss(exp), "lr": rates}


def scaling_runs(rules: tuple[str, ...] | None = None) -> dict:
    """On every rank (or in one process): every rule at this world size, on the same
    token budget: TOKENS_AT_ONE_RANK_STEPS / N steps of N x PER_RANK_BATCH windows.
    At one rank the scaled rules are the unscaled ones: only "unscaled" and the
    warmed-up "sqrt + warm-up" run there, unless ``rules`` says otherwise."""
    world_size = rank_world()[1]
    if rules is None:
        rules = tuple(RULES) if world_size > 1 else ("unscaled", "sqrt + warm-up")
    if TOKENS_AT_ONE_RANK_STEPS % world_size:
        raise ValueError(
            f"{TOKENS_AT_ONE_RANK_STEPS} steps of one rank do not split over "
            f"{world_size} ranks"
        )
    steps = TOKENS_AT_ONE_RANK_STEPS // world_size
    runs = {
        rule: train_with_rule(rule, steps, world_size * PER_RANK_BATCH)
        for rule in rules
    }
    return {
        "world_size": world_size,
        "steps": steps,
        "global_batch": world_size * PER_RANK_BATCH,
        "runs": runs,
    }


def one_process_losses(world_size: int, steps: int) -> list[float]:
    """One process at N x PER_RANK_BATCH with the unscaled rule: what N ranks'
    "unscaled" run must match step for step (call it where no process group is
    initialised)."""
    if rank_world()[1] != 1:
        raise RuntimeError(
            "one_process_losses is the one-process reference: call it outside the ranks"
        )
    return train_with_rule("unscaled", steps, world_size * PER_RANK_BATCH)["losses"]


def tokens_seen(global_batch: int, steps: int, block_size: int = 64) -> list[int]:
    """Tokens consumed after each of ``steps`` steps of ``global_batch`` windows."""
    return [global_batch * block_size * (s + 1) for s in range(steps)]


def lr_figure(scaling: dict, rules: tuple[str, ...]):
    """Left: the unscaled runs at every world size against the tokens seen. Right: the
    4-rank runs of every rule, step by step."""
    import matplotlib.pyplot as plt

    fig, (by_tokens, rules_ax) = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for n, colour in zip(scaling, ("black", "tab:blue", "tab:red")):
        res = scaling[n]
        tokens = tokens_seen(res["global_batch"], res["steps"])
        losses = res["runs"]["unscaled"]["losses"]
        by_tokens.plot(tokens, losses, color=colour, label=f"{n} rank{'s' * (n > 1)}")
    by_tokens.set(xlabel="tokens seen", ylabel="training loss")
    by_tokens.set_title("unscaled LR, same tokens", fontsize=11)
    by_tokens.legend(fontsize=10)
    four = scaling[max(scaling)]
    for rule, style in zip(rules, ("-", "--", "-.", ":")):
        losses = four["runs"][rule]["losses"]
        rules_ax.plot(range(1, len(losses) + 1), losses, style, label=rule, lw=1.5)
    rules_ax.set(xlabel="optimizer step")
    rules_ax.set_title(f"{max(scaling)} ranks, each rule", fontsize=11)
    rules_ax.legend(fontsize=10)
    for ax in (by_tokens, rules_ax):
        ax.tick_params(labelsize=10)
        ax.xaxis.label.set_size(11)
        ax.yaxis.label.set_size(11)
    fig.tight_layout()
    return fig
