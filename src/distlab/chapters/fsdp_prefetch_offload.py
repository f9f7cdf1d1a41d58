"""FSDP2's prefetching and CPU offload, run and measured on gloo ranks, for
``book/fsdp_prefetch_offload.md``.

    # every prefetch setting's timeline, and the offload tour, one launch
    ranks = run_ranks(measure, nprocs=2)
    # gathered bytes operator by operator, one panel per setting
    timeline_figure(ranks[0]["prefetch"])

``prefetch_timelines`` runs one forward and backward of a 6-block tiny GPT under each of
SETTINGS, recorded by ``distlab.tools.fsdp_timeline.GatheredTimeline``. ``offload``
shards the tiny GPT with and without ``CPUOffloadPolicy`` and says where every state
lives, what a step issues and costs. The GPU cost of offloading is a benchmark: ``python
-m distlab.bench.fsdp_offload``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

from distlab.data import token_data
from distlab.model import GPT, preset
from distlab.parallel import apply_fsdp
from distlab.runtime import rank_world
from distlab.tools.collective_bytes import CollectiveBytes
from distlab.tools.fsdp_timeline import GatheredTimeline, fsdp_units, gather_leads, peak

N_LAYER = 6  # blocks: enough for a prefetch of 2 to differ from one of 1

# name -> (the blocks' reshard_after_forward, explicit prefetch of this many blocks (0:
# FSDP2's implicit default), call root.unshard(async_op=True) before forward)
SETTINGS = {
    "implicit (default)": (True, 0, False),
    "implicit, reshard_after_forward=False": (False, 0, False),
    "explicit, 1 ahead": (True, 1, False),
    "explicit, 2 ahead": (True, 2, False),
    "explicit, 2 ahead, reshard_after_forward=False": (False, 2, False),
    "implicit + root.unshard(async_op=True)": (True, 0, True),
}


# --- begin prefetch ---
def set_prefetch(model, ahead: int) -> None:
    """Explicit prefetching, as PyTorch's FSDP2 example sets it: in forward each block
    all-gathers the next ``ahead`` blocks right after its own all-gather; in backward
    the previous ``ahead``, nearest first. A block with an empty backward list keeps
    FSDP2's default prefetch."""
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + ahead])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - ahead) : i][::-1])


def traced_step(model, x, y, async_root: bool = False):
    """One forward and backward under ``GatheredTimeline``, after an untimed one
    (FSDP2's lazy init, and the post-forward order its backward prefetch follows):
    (timeline, loss)."""
    model(x, y)[1].backward()
    model.zero_grad(set_to_none=True)
    with GatheredTimeline(fsdp_units(model)) as timeline:
        # the root's all-gather is issued now; its pre-forward waits for it
        if async_root:
            model.unshard(async_op=True)
        loss = model(x, y)[1]
        loss.backward()
    return timeline, loss.item()


# --- end prefetch ---


def tiny_blocks(n_layer: int = N_LAYER):
    return preset("tiny", n_layer=n_layer, vocab_size=token_data().vocab_size)


def unit_bytes(model) -> dict[str, int]:
    """Each unit's whole parameters as FSDP2 gathers them: every parameter padded to N
    equal chunks."""
    world = rank_world()[1]
    return {
        name: sum(
            p.padded_sharded_param_size.numel() * world * p.sharded_param.element_size()
            for g in unit._get_fsdp_state()._fsdp_param_groups
            for p in g.fsdp_params
        )
        for name, unit in fsdp_units(model).items()
    }


def summarise(timeline, sizes: dict[str, int], loss: float) -> dict:
    """What the page shows of one timeline: bytes per operator, the all-gathers,
    the peak."""
    index, top = peak(timeline.samples)
    leads = gather_leads(timeline)
    for row, g in zip(leads, timeline.gathers):
        row["index"] = g.index
    return {
        "whole": [s.whole for s in timeline.samples],
        "buffers": [s.buffers for s in timeline.samples],
        "backward_from": next(
            i for i, s in enumerate(timeline.samples) if s.phase == "backward"
        ),
        "gathers": leads,
        "peak": {
            "index": index,
            "bytes": top.whole + top.buffers,
            "whole": top.whole,
            "buffers": top.buffers,
            "held": list(top.held),
            "phase": top.phase,
        },
        "root_bytes": sizes["root"],
        "block_bytes": sizes["blocks.0"],
        "loss": loss,
    }


def prefetch_timelines(settings: dict = SETTINGS) -> dict[str, dict]:
    """Every setting's summarised timeline on this rank, the same batch and weights
    for all."""
    rank, world = rank_world()
    cfg = tiny_blocks()
    x, y = token_data().batch("train", 0, 2 * world, cfg.block_size, 0, rank, world)
    results = {}
    for name, (reshard, ahead, async_root) in settings.items():
        model = apply_fsdp(GPT(cfg), reshard_after_forward=reshard, check_weights=False)
        if ahead:
            set_prefetch(model, ahead)
        timeline, loss = traced_step(model, x, y, async_root)
        results[name] = summarise(timeline, unit_bytes(model), loss)
    return results


# --- begin offload ---
def shard_tiny(offload_policy=None):
    """The tiny GPT sharded block by block, then the root, with or without an
    offload policy."""
    return apply_fsdp(GPT(tiny_blocks(2)), offload_policy=offload_policy)


# --- end offload ---


def where_things_live(model, optimizer) -> dict[str, str]:
    """Devices of one parameter's shard, gradient and AdamW state, and where FSDP2
    gathers it."""
    p = next(model.parameters())
    fsdp_param = model._get_fsdp_state()._fsdp_param_groups[0].fsdp_params[0]
    state = optimizer.state[p]
    return {
        "sharded parameter (DTensor)": f"{p.device}; its local shard: "
        f"{p.to_local().device}{', pinned' if p.to_local().is_pinned() else ''}",
        "gathered to (FSDPParam.device)": str(fsdp_param.device),
        "offload_to_cpu": str(fsdp_param.offload_to_cpu),
        "sharded gradient": str(p.grad.to_local().device)
        if p.grad is not None
        else "none (set_to_none)",
        "AdamW exp_avg, exp_avg_sq": f"{state['exp_avg'].to_local().device}, "
        f"{state['exp_avg_sq'].to_local().device}",
    }


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def offload(steps: int = 8) -> dict:
    """The tiny GPT with and without ``CPUOffloadPolicy(pin_memory=False)``: where the
    states live, the operators and collectives of one step, the losses, and step times
    (interleaved, medians); and what ``CPUOffloadPolicy()`` (pinned, the default) does
    on a machine without an accelerator."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    rank, world = rank_world()
    out: dict = {}
    try:
        shard_tiny(CPUOffloadPolicy())
        out["pinned"] = "no error"
    except RuntimeError as error:
        out["pinned"] = f"{type(error).__name__}: {error}"
    policies = {
        "no offload": None,
        "CPUOffloadPolicy(pin_memory=False)": CPUOffloadPolicy(pin_memory=False),
    }
    runs = {name: shard_tiny(policy) for name, policy in policies.items()}
    optimizers = {
        name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in runs.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(steps):
        x, y = token_data().batch(
            "train",
            step,
            2 * world,
            runs["no offload"].config.block_size,
            0,
            rank,
            world,
        )
        # in turns, so drift in the machine's speed hits both alike
        for name, model in runs.items():
            with _OpCount() as ops, CollectiveBytes() as comms:
                start = time.perf_counter()
                loss = model(x, y)[1]
                loss.backward()
                optimizers[name].step()
                seconds[name].append(time.perf_counter() - start)
            if step == steps - 1:
                out[name] = {
                    "where": where_things_live(model, optimizers[name]),
                    "ops": sum(ops.ops.values()),
                    "copies": {k: v for k, v in ops.ops.items() if "copy" in k},
                    "gathered_bytes": comms.tensor_bytes().get("all-gather", 0),
                    "reduced_bytes": comms.tensor_bytes().get("reduce-scatter", 0),
                }
            optimizers[name].zero_grad(set_to_none=step < steps - 1)
            losses[name].append(loss.item())
    for name in runs:
        out[name]["losses"] = losses[name]
        timed = [1e3 * t for t in seconds[name][1:]]  # the first step: lazy init
        out[name]["step_ms"] = {
            "median": statistics.median(timed),
            "min": min(timed),
            "max": max(timed),
        }
    return out


def measure() -> dict:
    """``prefetch_timelines()`` and ``offload()`` in one launch: each launch costs
    seconds of imports."""
    return {"prefetch": prefetch_timelines(), "offload": offload()}


def timeline_figure(prefetch: dict[str, dict], names: list[str]):
    """One panel per setting: whole parameters and all-gather buffers held after each
    operator, in blocks' worth; a mark per all-gather (green: issued while another unit
    computed, a prefetch)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(names), 1, figsize=(10, 1.55 * len(names)), sharey=True
    )
    for ax, name in zip(axes, names):
        t = prefetch[name]
        block = t["block_bytes"]
        x = range(len(t["whole"]))
        ax.stackplot(
            x,
            [w / block for w in t["whole"]],
            [b / block for b in t["buffers"]],
            colors=["#3b6ea5", "#e39b4c"],
            labels=["whole parameters", "all-gather buffers"],
            step="post",
        )
        ax.axvline(t["backward_from"], color="black", lw=0.8, ls="--")
        for g in t["gathers"]:
            label = "r" if g["unit"] == "root" else g["unit"].removeprefix("blocks.")
            color = (
                "#7b3fa0"
                if g["issued by"] == "unshard()"
                else "#2a9d4b"
                if g["lead"]
                else "#777777"
            )
            ax.text(
                g["index"],
                7.6,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color=color,
                fontweight="normal" if color == "#777777" else "bold",
            )
        above_root = (t["peak"]["bytes"] - t["root_bytes"]) / block
        ax.set_title(
            f"{name}: at most the root and {above_root:.2f} blocks' worth",
            fontsize=8.5,
            loc="left",
        )
        ax.set_ylim(0, 8.2)
        ax.set_xlim(-12, len(t["whole"]))  # room for a label at the first operator
        ax.tick_params(labelsize=7)
    fig.legend(
        *axes[0].get_legend_handles_labels(), loc="upper right", fontsize=7, ncol=2
    )
    axes[-1].set_xlabel(
        "operators of one forward (left of the dashed line) and backward, rank 0",
        fontsize=8,
    )
    fig.supylabel(
        f"held, in blocks ({prefetch[names[0]]['block_bytes'] / 1024:.0f} KiB each)",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    return fig
