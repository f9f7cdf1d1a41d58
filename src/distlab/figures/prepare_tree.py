"""What ``accelerator.prepare`` returns, read from the real prepared objects and drawn
as three trees: one process, DDP on 2 ranks, FSDP2 (lab 6's path) on 2 ranks.

The Accelerate chapter's helpers (how a block's wrappers read, its CPU FSDP2 mode) come
in as arguments: a tool does not import a chapter."""

from __future__ import annotations

import torch

from distlab.model import GPT, preset


def _name(module) -> str:
    from torch.distributed.fsdp import FSDPModule

    name = type(module).__name__
    if isinstance(module, FSDPModule):
        group = module._get_fsdp_state()._fsdp_param_group
        n = len(group.fsdp_params) if group else 0
        return f"FSDP[{n}]({name.removeprefix('FSDP')})"
    return name


def describe(model, optimizer, unit_chain) -> list[tuple[int, str]]:
    """(depth, label) rows: the wrappers around the model, outermost first, its
    blocks with their wrappers (``unit_chain(block)``), and the optimizer's wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    rows, inner, depth = [], model, 0
    while isinstance(inner, DistributedDataParallel):
        rows.append((depth, "DistributedDataParallel"))
        inner, depth = inner.module, depth + 1
    amp = hasattr(model, "_original_forward") or hasattr(inner, "_original_forward")
    rows.append((depth, _name(inner) + (" + autocast" if amp else "")))
    for i, block in enumerate(inner.blocks):
        rows.append((depth + 1, f"blocks.{i}: {unit_chain(block)}"))
    wrapped = type(optimizer).__name__
    rows.append((0, f"{wrapped}({type(optimizer.optimizer).__name__})"))
    return rows


def _prepared(accelerator, model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return accelerator.prepare(model, opt)


def one_process(unit_chain) -> list[tuple[int, str]]:
    """In this process (no launcher): prepare, describe, then forget the
    Accelerator so that ``notebook_launcher`` may still fork ranks."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    rows = describe(*_prepared(accelerator, GPT(preset("tiny"), seed=0)), unit_chain)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return rows


def on_ranks(unit_chain, in_fsdp2_mode) -> dict:
    """On each of 2 ranks: lab 6's DDP path, then its FSDP2 path (checkpoint,
    ``apply_fsdp``, ``prepare`` in Accelerate's FSDP2 mode, ``in_fsdp2_mode``)."""
    from accelerate import Accelerator

    from distlab.accel import fsdp2_plugin
    from distlab.parallel import apply_activation_checkpointing, apply_fsdp

    ddp = describe(
        *_prepared(
            Accelerator(cpu=True, mixed_precision="bf16"), GPT(preset("tiny"), seed=0)
        ),
        unit_chain,
    )
    accelerator = in_fsdp2_mode(fsdp2_plugin(), "no")
    model = apply_activation_checkpointing(GPT(preset("tiny"), seed=0), "full")
    model = apply_fsdp(model, param_dtype=torch.bfloat16)
    return {"ddp": ddp, "fsdp2": describe(*_prepared(accelerator, model), unit_chain)}


def draw(trees: dict[str, list[tuple[int, str]]]):
    """One panel per setup, stacked: each row a box, indented by its depth."""
    import matplotlib.pyplot as plt

    heights = [len(rows) + 1 for rows in trees.values()]
    fig, axes = plt.subplots(
        len(trees),
        1,
        figsize=(6.4, 0.34 * sum(heights)),
        gridspec_kw={"height_ratios": heights},
    )
    colours = {"DistributedDataParallel": "#f4c27a", "FSDP": "#9fd3a6"}
    for ax, (title, rows) in zip(axes, trees.items()):
        ax.set_title(title, fontsize=14, fontweight="bold", loc="left")
        n = len(rows)
        for i, (depth, label) in enumerate(rows):
            colour = "#cfe0f5"
            for key, c in colours.items():
                if label.startswith(key):
                    colour = c
            if i == len(rows) - 1:
                colour = "#e6e6e6"
            text = label.replace("CheckpointWrapper", "Ckpt")
            ax.text(
                0.01 + 0.05 * depth,
                1 - (i + 0.5) / n,
                text,
                fontsize=13,
                family="monospace",
                va="center",
                bbox={"boxstyle": "round", "fc": colour, "ec": "#555555"},
            )
        ax.axis("off")
    fig.tight_layout()
    return fig
