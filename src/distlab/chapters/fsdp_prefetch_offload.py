"""FSDP2's prefetching and CPU offload, run and measured on gloo ranks, for
``book/fsdp_prefetch_offload.md``.

    # every prefetch setting's timeline, and the offload tour, one launch
    ranks = run_ranks(measure, nprocs=2)
    # gathered bytes operator by operator: a panel per setting, for a stepper
    setting_views(ranks[0]["prefetch"])

``prefetch_timelines`` runs one forward and backward of a 6-block tiny GPT under each of
SETTINGS, recorded by ``distlab.tools.fsdp_timeline.GatheredTimeline``. ``offload``
shards the tiny GPT with and without ``CPUOffloadPolicy`` and says where every state
lives, what a step issues and costs. The GPU cost of offloading is a benchmark: ``python
-m distlab.bench.fsdp_offload``, read by ``offload_bench`` and drawn by
``offload_bench_figure``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

from distlab.data import token_data
from distlab.figures.label_row import label_row
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
    batch, block = token_data().batch, runs["no offload"].config.block_size
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(steps):
        x, y = batch("train", step, 2 * world, block, 0, rank, world)
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


# slider names for SETTINGS, in order: short enough for a phone
SHORT = (
    "default",
    "no reshard",
    "1 ahead",
    "2 ahead",
    "2 ahead, no reshard",
    "async root",
)
BLUE, ORANGE, GREEN = "#3b6ea5", "#e39b4c", "#2a9d4b"
GREY, PURPLE = "#777777", "#7b3fa0"


def _panel(ax, t: dict, title: str, font: float, top: float = 8) -> None:
    """One setting: whole parameters and all-gather buffers held after each operator,
    in blocks' worth. Leaves room above it for ``_gather_labels``."""
    block, n = t["block_bytes"], len(t["whole"])
    ax.stackplot(
        range(n),
        [w / block for w in t["whole"]],
        [b / block for b in t["buffers"]],
        colors=[BLUE, ORANGE],
        labels=["whole parameters", "all-gather buffers"],
        step="post",
    )
    ax.axvline(t["backward_from"], color="black", lw=0.8, ls="--")
    ax.set_xlim(-0.02 * n, 1.02 * n)
    above_root = (t["peak"]["bytes"] - t["root_bytes"]) / block
    ax.set_title(
        f"{title}: root + {above_root:.0f} blocks at most",
        fontsize=font - 1,
        loc="left",
        pad=2.2 * font,
    )
    ax.set_ylim(0, top)
    ax.set_yticks(range(0, int(top) + 1, 2))
    # forward and backward, named under their halves instead of operator numbers
    ax.set_xticks(
        [t["backward_from"] / 2, (t["backward_from"] + n) / 2], ["forward", "backward"]
    )
    ax.tick_params(labelsize=font, length=0)


def _gather_labels(ax, t: dict, font: float) -> None:
    """Above ``_panel``'s axes, once laid out: a label per all-gather at the operator
    that issued it (``r`` the root, digits the blocks; green a prefetch, grey its own
    pre-forward, purple ``unshard()``), forward's left of the dashed line."""
    gathers = t["gathers"]
    colors = [
        PURPLE if g["issued by"] == "unshard()" else GREEN if g["lead"] else GREY
        for g in gathers
    ]
    label_row(
        ax,
        [g["index"] for g in gathers],
        [g["unit"].removeprefix("blocks.").replace("root", "r") for g in gathers],
        colors,
        [c != GREY for c in colors],
        font,
        split=t["backward_from"],
    )


def setting_figure(t: dict, title: str):
    """One setting's panel, large enough for a phone: the views of the page's
    stepper."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.4))
    _panel(ax, t, title, font=16)
    ax.set_ylabel("held (blocks)", fontsize=16)
    ax.set_xlabel("operators of one step, rank 0", fontsize=15)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2,
               fontsize=14, frameon=False, handlelength=1, columnspacing=1)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    _gather_labels(ax, t, 16)
    return fig


def setting_views(prefetch: dict[str, dict]) -> list:
    """A figure per setting, in SETTINGS order, for ``distlab.infra.stepper``."""
    return [
        setting_figure(prefetch[name], short) for name, short in zip(SETTINGS, SHORT)
    ]


def timeline_figure(prefetch: dict[str, dict], names: list[str]):
    """All the settings' panels, one under the other, for comparing them."""
    import matplotlib.pyplot as plt

    font = 15  # a column of panels, 6 inches wide: readable on a phone too
    fig, axes = plt.subplots(len(names), 1, figsize=(6, 2.9 * len(names)), sharey=True)
    short = dict(zip(SETTINGS, SHORT))
    for ax, name in zip(axes, names):
        _panel(ax, prefetch[name], short[name], font=font)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2,
               fontsize=font, frameon=False)  # fmt: skip
    axes[-1].set_xlabel("operators of one step, rank 0", fontsize=font)
    fig.supylabel("held, in blocks", fontsize=font)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    for ax, name in zip(axes, names):
        _gather_labels(ax, prefetch[name], font)
    return fig


def offload_bench(bench: dict) -> dict:
    """The recorded GPU offload benchmark, read: per (dtype, offload) its median step
    (ms), its GPU bytes between steps and at the peak; and the 12 bytes per parameter
    (fp32 weights, AdamW's two moments) that offloading takes off the GPU."""
    runs = {(r["dtype"], r["offload"]): r for r in bench["runs"]}
    return {
        "runs": runs,
        "params": bench["settings"]["parameters"],
        "moved": 12 * bench["settings"]["parameters"],
        "drop": {
            dtype: runs[(dtype, False)]["gpu_bytes_between_steps"]
            - runs[(dtype, True)]["gpu_bytes_between_steps"]
            for dtype in bench["settings"]["dtypes"]
        },
    }


def offload_bench_figure(bench: dict):
    """The recorded GPU benchmark: step time, and GPU memory between steps and at
    the peak, without and with CPUOffloadPolicy, per dtype. One column, large
    labels: it is read on phones."""
    import matplotlib.pyplot as plt

    font = 15
    runs = offload_bench(bench)["runs"]
    dtypes = bench["settings"]["dtypes"]
    fig, (left, right) = plt.subplots(2, 1, figsize=(5, 6.6))
    width = 0.38
    for k, (offload, color) in enumerate(((False, BLUE), (True, ORANGE))):
        label = "CPUOffloadPolicy" if offload else "no offload"
        xs = [i + (k - 0.5) * width for i in range(len(dtypes))]
        steps = [runs[(d, offload)]["step_s"] for d in dtypes]
        med = [1e3 * runs[(d, offload)]["step_s_median"] for d in dtypes]
        spread = [
            [m - 1e3 * min(s) for m, s in zip(med, steps)],
            [1e3 * max(s) - m for m, s in zip(med, steps)],
        ]
        left.bar(xs, med, width, color=color, label=label, yerr=spread, capsize=3)
        gib = [runs[(d, offload)]["gpu_bytes_between_steps"] for d in dtypes]
        between = [b / 2**30 for b in gib]
        top = [runs[(d, offload)]["peak_gpu_bytes"] / 2**30 for d in dtypes]
        right.bar(xs, top, width, color=color, alpha=0.35)
        right.bar(xs, between, width, color=color, label=label)
    for ax, title in (
        (left, "step (ms): median, min-max"),
        (right, "GPU GiB: between steps (solid)\nand at the peak (pale)"),
    ):
        ax.set_xticks(range(len(dtypes)), dtypes, fontsize=font)
        ax.set_title(title, fontsize=font, loc="left")
        ax.tick_params(labelsize=font - 1)
        ax.spines[["top", "right"]].set_visible(False)
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=2,
               fontsize=font - 1, frameon=False, handlelength=1)  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig
