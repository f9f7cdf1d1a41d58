"""The ZeRO memory chapter's experiments: ZeRO-1 from scratch
(``distlab.scratch.zero1``) against torch's ``ZeroRedundancyOptimizer`` and one
process; the calculator (``distlab.tools.memory_calculator``) against bytes counted on
real DDP and FSDP2 ranks, what FSDP2 gathers during a step, and activations saved with
and without checkpointing. The figures are in ``distlab.figures.memory_figures``.

    run_ranks(zero1_gpt, nprocs=2)  # losses, parameters, owners, bytes per rank
    measured = {n: run_ranks(measure_one_step, nprocs=n) for n in (2, 4)}
    # counted == exact prediction, vs the calculator
    measured_rows(measured)
    activation_rows([("tiny", 8), ("shakespeare", 2)])
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from distlab.chapters.activation_checkpointing import checkpoint_blocks
from distlab.figures.memory_figures import reduction  # noqa: F401 (for the page)
from distlab.memory import activation_peak_bytes, saved_activation_bytes, state_bytes
from distlab.model import GPT, GPTConfig, parameter_formula, preset
from distlab.tools.memory_calculator import (
    GPT2_SMALL,
    activation_bytes,
    gathered_params,
    per_rank_bytes,
)
from distlab.tools.memory_checks import (  # noqa: F401 (paper_table_1: for the page)
    allocated_state_bytes,
    exact_adamw_state_bytes,
    paper_table_1,
)

# the strategies measure_one_step runs, in the project's names
MEASURED = ("ddp", "fsdp2", "fsdp2-bf16")


# --- begin measure ---
def measure_one_step(
    preset_name: str = "tiny", global_batch: int = 8, seed: int = 0
) -> dict:
    """Run on every rank (``run_ranks``): one fused-AdamW step under DDP, then FSDP2,
    then FSDP2 computing in bf16, and the bytes this rank then holds, counted from the
    tensors (before ``zero_grad``, so the gradients are still there)."""
    from distlab.infra.experiment import build, gpt

    out = {"shapes": [tuple(p.shape) for p in gpt(preset_name).parameters()]}
    # fsdp2-bf16 computes in bf16; its shards, gradients and AdamW stay fp32
    for strategy in MEASURED:
        # the GPT, wrapped, with fused AdamW
        exp = build(strategy, preset_name, global_batch, seed)
        exp.backward(exp.loss(step=0))
        exp.optimizer.step()  # AdamW creates its state on the first step
        counted = state_bytes(exp.model, exp.optimizer)
        out[strategy] = {
            "counted": counted,
            "allocated": allocated_state_bytes(exp.model, exp.optimizer),
        }
    return out


# --- end measure ---


def measured_rows(measured: dict[int, list[dict]]) -> list[dict]:
    """For every world size, rank and strategy (DDP, FSDP2): the bytes counted on the
    rank, the exact prediction from the parameter shapes, and the calculator's 16 bytes
    per parameter (divided by N under ZeRO-3 = FSDP2)."""
    rows = []
    for n, ranks in measured.items():
        shapes = ranks[0]["shapes"]
        n_params = sum(math.prod(s) for s in shapes)
        for rank, got in enumerate(ranks):
            for kind, fsdp2, strategy in (
                ("ddp", False, "ddp"),
                ("fsdp2", True, "fsdp2"),
            ):
                counted = got[kind]["counted"]["total"]
                calculator = per_rank_bytes(n_params, n, "fp32", "adamw", strategy)[
                    "total"
                ]
                exact = exact_adamw_state_bytes(shapes, n, rank, fsdp2)["total"]
                rows.append(
                    {
                        "ranks": n,
                        "rank": rank,
                        "strategy": kind,
                        "counted": counted,
                        "exact": exact,
                        "calculator": calculator,
                        "difference": counted - calculator,
                    }
                )
    return rows


def activation_rows(cases: list[tuple[str, int]]) -> list[dict]:
    """For each (preset, batch) at full context: bytes saved for backward without and
    with every block checkpointed, counted with a pack hook, and the
    calculator's formula."""
    rows = []
    for name, batch in cases:
        cfg = preset(name)
        idx, targets = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size))
        plain = saved_activation_bytes(GPT(cfg), idx, targets)
        checkpointed = saved_activation_bytes(checkpoint_blocks(GPT(cfg)), idx, targets)
        off, on = (
            activation_bytes(cfg, batch, cfg.block_size, ac) for ac in (False, True)
        )
        rows.append(
            {
                "preset": name,
                "batch": batch,
                "plain": plain,
                "checkpointed": checkpointed,
                "formula_plain": off["saved"],
                "formula_checkpointed": on["saved"],
                "peak": on["peak"],
            }
        )
    return rows


# GPT-2's vocabulary on a small model: the logits, not the blocks, set the peak
WIDE_VOCABULARY = preset("tiny", vocab_size=GPT2_SMALL.vocab_size)


def peak_rows(
    cases: list[tuple[str, GPTConfig, int]],
    checkpointing: tuple[bool, ...] = (False, True),
) -> list[dict]:
    """For each (name, config, batch) at full context, in fp32 and with bf16 parameters,
    without and with every block checkpointed: the activation peak ``MemTracker``
    measures during one forward and backward, and the calculator's
    (``activation_bytes``), with the moment it picks."""
    rows = []
    for name, cfg, batch in cases:
        idx, targets = torch.randint(0, cfg.vocab_size, (2, batch, cfg.block_size))
        for dtype, torch_dtype in (
            ("fp32", torch.float32),
            ("bf16_mixed", torch.bfloat16),
        ):
            for ac in checkpointing:
                model = GPT(cfg).to(torch_dtype)
                measured = activation_peak_bytes(
                    checkpoint_blocks(model) if ac else model, idx, targets
                )
                predicted = activation_bytes(cfg, batch, cfg.block_size, ac, dtype)
                rows.append(
                    {
                        "model": name,
                        "batch": batch,
                        "dtype": dtype,
                        "checkpointing": ac,
                        "measured": measured["peak"],
                        "calculator": predicted["peak"],
                        "at": predicted["at"],
                        "error": (predicted["peak"] - measured["peak"])
                        / measured["peak"],
                    }
                )
    return rows


def fsdp2_gathered(n_layer: int = 4, global_batch: int = 4) -> dict[str, dict]:
    """Run on every rank: a GPT of ``n_layer`` tiny blocks under FSDP2 (``apply_fsdp``),
    with and without resharding after forward. In the middle of every block's forward
    and backward, the bytes this rank holds in gathered parameters: unsharded units,
    all-gathers already done for a unit that has not started (a prefetch), and the
    all-gather buffer kept in forward until the next unit's copy-out
    (``comm_ctx.all_gather_state``, on any device). Their most in forward, in
    backward, and the calculator's, by its strategy name ("fsdp2",
    "fsdp2-no-reshard")."""
    from distlab.data import token_data
    from distlab.parallel import apply_fsdp
    from distlab.runtime import dist_env, pick_device, rank_world

    cfg = preset("tiny", n_layer=n_layer, vocab_size=token_data().vocab_size)
    rank, n = rank_world()
    device = pick_device("auto", dist_env()[1])  # NCCL ranks gather on their GPU
    x, y = token_data().batch(
        "train", 0, global_batch, cfg.block_size, 0, rank, n, device
    )
    out = {}
    for reshard in (True, False):
        model = apply_fsdp(GPT(cfg).to(device), reshard_after_forward=reshard)
        groups = [
            g
            for m in [*model.blocks, model]
            for g in m._get_fsdp_state()._fsdp_param_groups
        ]

        def gathered_now(groups=groups) -> int:
            held = 0
            for g in groups:
                # the unit's parameters, whole (padded to N equal pieces)
                if g.is_unsharded:
                    held += sum(
                        t.untyped_storage().nbytes()
                        for p in g.fsdp_params
                        for t in p.all_gather_outputs
                    )
                # prefetched: gathered, not yet copied out
                elif g._all_gather_result is not None:
                    gathered = g._all_gather_result.all_gather_output
                    held += gathered.untyped_storage().nbytes()
            kept = groups[0].comm_ctx.all_gather_state  # forward's deferred free
            if kept is not None:
                held += (
                    kept.all_gather_result.all_gather_output.untyped_storage().nbytes()
                )
            return held

        samples: dict[str, list[int]] = {"forward": [], "backward": []}

        # the MLP: mid-block, both ways
        def probe(module, args, output, samples=samples, now=gathered_now):
            samples["forward"].append(now())
            output.register_hook(lambda grad: samples["backward"].append(now()))

        for block in model.blocks:
            block.mlp.register_forward_hook(probe)
        model(x, y)[1].backward()
        strategy = "fsdp2" if reshard else "fsdp2-no-reshard"
        # the calculator's, fp32
        whole = gathered_params(strategy, parameter_formula(cfg), cfg)
        out[strategy] = {
            "forward": max(samples["forward"]),
            "backward": max(samples["backward"]),
            "calculator": 4 * whole,
        }
    return out


def zero1_compare(
    make_model,
    batch,
    optimizer_class: type,
    steps: int = 3,
    scratch_class: type | None = None,
    **kwargs,
) -> dict:
    """Run on every rank: ``steps`` steps of ``make_model()`` under DDP with our
    ``ShardedOptimizer``, with torch's ``ZeroRedundancyOptimizer``, and in one process
    on the whole batch. ``batch(step, rank, n)`` gives this rank's ``(x, y)`` (the
    global batch when n is 1); the loss is ``model(x, y)[1]`` for the GPT,
    cross-entropy otherwise. Returns losses, gradient norms, differences, owners,
    bytes."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distlab.scratch.zero1 import ShardedOptimizer

    rank, n = dist.get_rank(), dist.get_world_size()
    runs = {}
    for kind in ("scratch", "torch", "single"):
        model = make_model()  # seeded inside: the same weights on every rank
        params = list(model.parameters())
        if kind == "single":
            net, opt = model, optimizer_class(params, **kwargs)
        else:
            net = DDP(model)  # averages the gradients: every rank holds all of them
            cls = (scratch_class or ShardedOptimizer) if kind == "scratch" else None
            opt = (
                cls(params, optimizer_class, **kwargs)
                if cls
                else ZeroRedundancyOptimizer(params, optimizer_class, **kwargs)
            )
        losses, norms = [], []
        for step in range(steps):
            x, y = batch(step, *((0, 1) if kind == "single" else (rank, n)))
            out = net(x, y) if isinstance(model, GPT) else net(x)
            loss = (
                out[1]
                if isinstance(model, GPT)
                else nn.functional.cross_entropy(out, y)
            )
            loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            norms.append(
                torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            )
            if kind == "scratch" and step == 0:
                trace = _trace_first_step(opt, params)
            else:
                opt.step()
            if kind == "scratch" and step == steps - 1:  # gradients still there
                held = state_bytes(model, opt)
            opt.zero_grad()
            loss = loss.detach()
            if kind != "single":  # the global batch's mean: equal rows per rank
                dist.all_reduce(loss)
                loss /= n
            losses.append(loss.item())
        runs[kind] = {
            "losses": losses,
            "norms": [v.item() for v in norms],
            "params": [p.detach().clone() for p in params],
        }
        if kind == "scratch":
            owners = opt.owner
        elif kind == "torch":
            torch_owner = {
                p: r
                for r, groups in enumerate(opt._partition_parameters())
                for g in groups
                for p in g["params"]
            }
            torch_owners = [torch_owner[p] for p in params]
            torch_optimizer_bytes = state_bytes(model, opt.optim)["optimizer"]
    ours, theirs, single = (runs[k]["params"] for k in ("scratch", "torch", "single"))
    return {
        "sizes": [p.numel() for p in ours],
        "owners": owners,
        "torch_owners": torch_owners,
        "bytes": held,  # params, grads, optimizer on this rank (ours)
        "trace": trace,  # what the first step changed on this rank, and when
        "torch_optimizer_bytes": torch_optimizer_bytes,
        # largest absolute difference from torch's ZeRO-1, over every parameter
        "vs_torch": max((a - b).abs().max().item() for a, b in zip(ours, theirs)),
        # and from one process, relative to the parameter's size
        "vs_single": max(
            ((a - b).norm() / b.norm()).item() for a, b in zip(ours, single)
        ),
        **{f"{k}_{q}": runs[k][q] for k in runs for q in ("losses", "norms")},
    }


def _trace_first_step(opt, params: list) -> dict[str, list[bool]]:
    """``opt.step()``, watched: per tensor, on this rank, whether it has a gradient,
    optimizer state, a new value after the inner step (before the broadcasts: a post
    hook of the inner optimizer) and after the broadcasts."""
    before = [p.detach().clone() for p in params]

    def changed() -> list[bool]:
        return [not torch.equal(p, b) for p, b in zip(params, before)]

    seen = {"local": [False] * len(params)}  # a rank that owns nothing changes nothing
    if opt.optimizer is not None:
        opt.optimizer.register_step_post_hook(
            lambda *_: seen.update(local=changed()) if "done" not in seen else None
        )
    trace = {"grad": [p.grad is not None for p in params]}
    opt.step()
    seen["done"] = True
    state = opt.state
    trace.update(local=seen["local"], broadcast=changed())
    trace["state"] = [p in state for p in params]
    return trace


def zero1_gpt(steps: int = 3, global_batch: int = 8) -> dict:
    """``zero1_compare`` on the tiny GPT with AdamW (the page's run)."""
    from distlab.data import token_data
    from distlab.infra.experiment import gpt

    data = token_data()

    def batch(step, rank, n):
        return data.batch("train", step, global_batch, 64, 0, rank, n)

    return zero1_compare(
        lambda: gpt("tiny", seed=0), batch, torch.optim.AdamW, steps, lr=1e-3
    )
