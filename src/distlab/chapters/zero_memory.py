"""The ZeRO memory chapter's experiments: the calculator
(``distlab.tools.memory_calculator``) checked against the ZeRO paper's Table 1, against
bytes counted on real DDP and FSDP2 ranks, and against activations saved with and
without checkpointing; and the page's figures.

    # every cell: ours, printed, how they agree
    paper_table_1()
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
from distlab.memory import activation_peak_bytes, saved_activation_bytes, state_bytes
from distlab.model import GPT, GPTConfig, parameter_formula, preset
from distlab.tools.memory_calculator import (
    GB,
    GPT2_SMALL,
    activation_bytes,
    estimate,
    gathered_params,
    per_rank_bytes,
)
from distlab.tools.memory_checks import (
    PAPER_DP,
    PAPER_TABLE_1,
    agrees_with_print,
    exact_adamw_state_bytes,
)

# the paper's stage -> the calculator's strategy
STAGE_NAMES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
# the strategies measure_one_step runs, in the project's names
MEASURED = ("ddp", "fsdp2", "fsdp2-bf16")


def paper_table_1() -> list[dict]:
    """Each cell of the paper's Table 1 (bf16 mixed precision, AdamW) as the calculator
    computes it, next to the printed value and how the two agree ("rounded", "truncated"
    or None)."""
    rows = []
    for psi, stages in PAPER_TABLE_1.items():
        for stage, printed in stages.items():
            for n, cell in zip(PAPER_DP, printed.split()):
                ours = (
                    per_rank_bytes(psi, n, "bf16_mixed", "adamw", STAGE_NAMES[stage])[
                        "total"
                    ]
                    / GB
                )
                rows.append(
                    {
                        "psi": psi,
                        "stage": stage,
                        "ranks": n,
                        "ours_gb": ours,
                        "printed": cell,
                        "agrees": agrees_with_print(ours, cell),
                    }
                )
    return rows


def reduction(strategy: str, n: int, dtype: str) -> float:
    """Model-state bytes per rank under DDP over those under ``strategy`` on ``n``
    ranks (AdamW)."""
    return (
        per_rank_bytes(1.0, 1, dtype)["total"]
        / per_rank_bytes(1.0, n, dtype, "adamw", strategy)["total"]
    )


def stages_figure(psi: float = 7.5e9, ns: list[int] | None = None):
    """Left: GB per rank against N for each stage. Right: each stage's reduction against
    DDP, in bf16 mixed precision (K = 12) and fp32."""
    import matplotlib.pyplot as plt

    ns = ns or [2**i for i in range(11)]
    colors = ["#888", "#3b6ea5", "#6c9bd2", "#e39b4c"]
    names = ["DDP", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)", "ZeRO-3 (P_os+g+p)"]
    fig, (ax_bytes, ax_red) = plt.subplots(1, 2, figsize=(10, 3.6))
    for stage, strategy in STAGE_NAMES.items():
        gb = [
            per_rank_bytes(psi, n, "bf16_mixed", "adamw", strategy)["total"] / GB
            for n in ns
        ]
        ax_bytes.plot(ns, gb, marker="o", ms=3, color=colors[stage], label=names[stage])
    ax_bytes.set(
        yscale="log",
        ylabel="GB per rank",
        title=f"{psi / 1e9:g}B parameters, bf16 mixed, AdamW",
    )
    ax_bytes.axhline(32, color="k", lw=0.6, ls=":")
    ax_bytes.text(2**7, 36, "32 GB (V100)", fontsize=8)
    ax_bytes.legend(fontsize=8)
    for stage in (1, 2, 3):
        for dtype, style, marker in (("bf16_mixed", "-", None), ("fp32", "--", "x")):
            if stage == 3 and dtype == "fp32":
                continue  # the same line, N, for any precision
            label = names[stage] + (
                "" if stage == 3 else ", K=12" if dtype == "bf16_mixed" else ", fp32"
            )
            values = [reduction(STAGE_NAMES[stage], n, dtype) for n in ns]
            ax_red.plot(
                ns, values, style, marker=marker, ms=4, color=colors[stage], label=label
            )
    for limit in (2, 4, 8):
        ax_red.axhline(limit, color="k", lw=0.5, ls=":")
        ax_red.text(1.05, limit + 0.2, f"{limit}x", fontsize=8)
    ax_red.set(
        ylim=(0, 12), ylabel="reduction vs DDP", title="model-state reduction per rank"
    )
    ax_red.legend(fontsize=7, loc="upper right")
    for ax in (ax_bytes, ax_red):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks N")
    fig.tight_layout()
    return fig


# --- begin measure ---
def allocated_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, int]:
    """Like ``state_bytes``, but the bytes of the storages behind the tensors, each
    counted once."""

    def storage_bytes(tensors) -> int:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return sum(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in local
            }.values()
        )

    params = list(model.parameters())
    out = {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": storage_bytes(
            v
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


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
                ("fsdp2", True, "zero3"),
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
    and backward, the bytes this rank holds in gathered parameters: unsharded units, and
    all-gathers already done for a unit that has not started (a prefetch). Their most,
    and the calculator's, by the calculator's strategy name ("zero3",
    "fsdp2_no_reshard")."""
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
            return held

        samples: list[int] = []

        # the MLP: mid-block, both ways
        def probe(module, args, output, samples=samples, now=gathered_now):
            samples.append(now())
            output.register_hook(lambda grad: samples.append(now()))

        for block in model.blocks:
            block.mlp.register_forward_hook(probe)
        model(x, y)[1].backward()
        strategy = "zero3" if reshard else "fsdp2_no_reshard"
        # the calculator's, fp32
        whole = gathered_params(strategy, parameter_formula(cfg), cfg)
        out[strategy] = {"measured": max(samples), "calculator": 4 * whole}
    return out


def breakdown_figure(
    model: str, ranks: int, micro_batch: int, seq_len: int, dtype: str = "bf16_mixed"
):
    """Bytes per rank by part under each ZeRO stage, and ZeRO-3 with activation
    checkpointing, as the calculator estimates them; the estimates come back with
    the figure."""
    import matplotlib.pyplot as plt

    colors = {
        "params": "#3b6ea5",
        "grads": "#6c9bd2",
        "optimizer": "#a9c6ea",
        "gathered": "#7a9e5a",
    }
    colors["activations"] = "#e39b4c"
    cases = [(s, False) for s in STAGE_NAMES.values()] + [("zero3", True)]
    estimates = {}
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for row, (strategy, ac) in enumerate(cases):
        est = estimate(
            model,
            ranks,
            dtype,
            "adamw",
            strategy,
            micro_batch=micro_batch,
            seq_len=seq_len,
            activation_checkpointing=ac,
        )
        estimates[strategy + (" + AC" if ac else "")] = est
        left = 0.0
        for part, color in colors.items():
            ax.barh(
                row,
                (est[part] or 0) / GB,
                left=left / GB,
                color=color,
                label=part if row == 0 else None,
            )
            left += est[part] or 0
    ax.set_yticks(range(len(cases)), list(estimates))
    ax.invert_yaxis()
    ax.set_xlabel("GB per rank")
    ax.legend(ncol=4, fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig, estimates
