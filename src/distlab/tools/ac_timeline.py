"""One training step's forward, recompute and backward, block by block, on a
work-counted clock, with the activation bytes alive at every moment.

``record_step`` runs one forward and backward of a GPT and notes, per block, when its
forward ran, when it ran again inside the backward pass (the recompute of activation
checkpointing), and when its backward ran. The clock is not wall time: it advances by
the work of each aten operator dispatched (the FLOPs of matrix products and
attention, one per element for every other operator), so the picture is the same on
every machine and under any load. PyTorch's ``MemTracker`` gives the bytes of
activations and temporaries alive after each operator.

    steps = {name: record_step(model_for(name), idx, targets) for name in POLICIES}
    timeline_stepper(steps)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from distlab.memory import tracker_snapshot
from distlab.model import GPT, preset
from distlab.parallel import apply_activation_checkpointing

# (label, mode, every): the policies the timeline compares
POLICIES = [
    ("no checkpointing", "none", 1),
    ("full", "full", 1),
    ("full, every 2nd block", "full", 2),
    ("selective", "selective", 1),
]
COLORS = {"forward": "tab:blue", "recompute": "tab:orange", "backward": "tab:green"}


def timeline_model(mode: str, every: int = 1, n_layer: int = 4) -> GPT:
    """The ``tiny`` GPT with ``n_layer`` blocks (4: every-2nd has something to skip),
    checkpointed by ``mode``/``every``; the same weights for every policy."""
    cfg = dataclasses.replace(preset("tiny"), n_layer=n_layer)
    return apply_activation_checkpointing(GPT(cfg), mode, every)


def _work(func, args, out) -> int:
    """The work of one operator, from the shapes of its arguments and outputs: FLOPs
    for matrix products and attention, else one per output element."""
    if "scaled_dot_product" in str(func):  # (B, H, T, D) query; the CPU kernel is
        q = args[1] if "backward" in str(func) else args[0]  # not in the registry
        b, h, t, d = q
        return 4 * b * h * t * t * d * (2 if "backward" in str(func) else 1)
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        return formula(*args, out_val=out)
    # a torch.Size is a tuple too: only a tuple of them is several outputs
    several = isinstance(out, (tuple, list)) and not isinstance(out, torch.Size)
    first = out[0] if several and out else out
    return first.numel() if isinstance(first, torch.Size) else 0


class _Clock(TorchDispatchMode):
    """Advances by each operator's work and samples the tracker's live bytes."""

    def __init__(self, tracker, device):
        super().__init__()
        self.now, self.tracker, self.device = 0, tracker, device
        self.samples: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from torch.utils._pytree import tree_map_only

        shapes = tree_map_only(torch.Tensor, lambda t: t.shape, (args, out))
        self.now += _work(func, *shapes)
        live = tracker_snapshot(self.tracker, "current", self.device)
        kinds = {str(k).rsplit(".", 1)[-1]: v for k, v in live.items()}
        self.samples.append((self.now, kinds.get("ACT", 0) + kinds.get("TEMP", 0)))
        return out


def _inner(block: nn.Module) -> nn.Module:
    """The Block itself, inside a checkpoint wrapper or not."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def record_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> dict:
    """One forward and backward of ``model``: ``events`` [(kind, block, start, end)]
    with kind forward, recompute or backward, and ``samples`` [(clock, live bytes)]
    of activations and temporaries; ``checkpointed``: which blocks are wrapped."""
    from torch.distributed._tools.mem_tracker import MemTracker

    events: list[tuple[str, int, int, int]] = []
    state = {"backward": False}
    opened: dict[int, int] = {}
    handles = []
    device = next(model.parameters()).device
    tracker = MemTracker()
    tracker.track_external(model)
    clock = _Clock(tracker, device)

    for i, block in enumerate(model.blocks):

        def pre(module, args, i=i):
            opened[i] = clock.now

        def post(module, args, out, i=i):
            kind = "recompute" if state["backward"] else "forward"
            events.append((kind, i, opened.pop(i), clock.now))
            if kind == "forward":  # backward of block i: from d(out) to d(in)
                out.register_hook(lambda g, i=i: opened.__setitem__(-1 - i, clock.now))
                args[0].register_hook(
                    lambda g, i=i: events.append(
                        ("backward", i, opened.pop(-1 - i), clock.now)
                    )
                )

        inner = _inner(block)
        handles += [inner.register_forward_pre_hook(pre)]
        # always_call: a recompute stops early (an exception) once it has recomputed
        # what backward asked for (torch.utils.checkpoint's early stop)
        handles += [inner.register_forward_hook(post, always_call=True)]
    try:
        with tracker, clock:
            loss = model(idx, targets)[1]
            state["backward"] = True
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    return {
        "events": events,
        "samples": clock.samples,
        "checkpointed": [_inner(b) is not b for b in model.blocks],
        "end": clock.now,
    }


def record_policies(batch: int = 8, seed: int = 0) -> dict[str, dict]:
    """``record_step`` for every policy in ``POLICIES``, on the same batch."""
    cfg = preset("tiny")
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(
        0, cfg.vocab_size, (2, batch, cfg.block_size), generator=gen
    )
    return {
        label: record_step(timeline_model(mode, every), idx, targets)
        for label, mode, every in POLICIES
    }


def timeline_figure(steps: dict[str, dict], shown: str):
    """Policy ``shown``: its blocks' forward, recompute and backward on the work
    clock (top), and the activation bytes alive (bottom), no checkpointing in grey."""
    import matplotlib.pyplot as plt

    step = steps[shown]
    none = next(iter(steps.values()))
    scale = none["end"]  # no checkpointing's whole step = 1
    # narrow and tall, large type: shown ~360 px wide on a phone
    fig, (lanes, memory) = plt.subplots(
        2, 1, figsize=(4.6, 5.4), sharex=True, height_ratios=[3, 2]
    )
    n = len(step["checkpointed"])
    # a recompute runs inside its block's backward: drawn on top of it
    for kind, block, start, end in sorted(
        step["events"], key=lambda e: e[0] != "backward"
    ):
        width = (end - start) / scale
        if kind == "recompute":  # selective's is a sliver: kept visible
            width = max(width, 0.01)
        lanes.barh(
            n - 1 - block, width, left=start / scale, height=0.7,
            color=COLORS[kind], edgecolor="white", linewidth=0.5,
        )  # fmt: skip
    lanes.set_yticks(
        range(n),
        [
            f"{i}" + (" ckpt" if step["checkpointed"][i] else "")
            for i in reversed(range(n))
        ],
        fontsize=13,
    )
    lanes.set_ylabel("block", fontsize=13)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    lanes.legend(handles, COLORS, ncol=3, fontsize=12, loc="lower center",
                 bbox_to_anchor=(0.45, 1.0), frameon=False, handlelength=0.8,
                 columnspacing=0.6, handletextpad=0.3)  # fmt: skip
    fig.suptitle(shown, fontsize=15)
    lanes.set_ylim(-0.6, n - 0.4)
    for s, style in ((none, {"color": "0.7"}), (step, {"color": "black"})):
        x = [t / scale for t, _ in s["samples"]]
        memory.plot(x, [b / 1e6 for _, b in s["samples"]], lw=1.8, **style)
    memory.set_ylabel("MB alive", fontsize=13)
    memory.set_xlabel("work (none = 1)", fontsize=13)
    memory.set_ylim(0, None)
    memory.set_xlim(0, max(s["end"] for s in steps.values()) / scale)
    memory.tick_params(labelsize=12)
    lanes.tick_params(labelsize=12)
    for ax in (lanes, memory):
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def timeline_stepper(steps: dict[str, dict]):
    """A slider over the policies, one pre-rendered ``timeline_figure`` each."""
    from distlab.infra.stepper import stepper

    names = list(steps)
    views = [timeline_figure(steps, name) for name in names]
    return stepper(views, "policy", start=1, interval_ms=2500, options=names)


def facts(step: dict) -> dict:
    """What the page asserts of one recorded step: blocks recomputed, in which order,
    each recompute inside its own block's backward, and the peak of live bytes."""
    recomputed = [b for k, b, _, _ in step["events"] if k == "recompute"]
    spans = {(k, b): (s, e) for k, b, s, e in step["events"] if k != "forward"}
    inside = all(
        spans[("backward", b)][0] <= spans[("recompute", b)][0]
        and spans[("recompute", b)][1] <= spans[("backward", b)][1]
        for b in recomputed
    )
    return {
        "recomputed": recomputed,
        "recompute inside its backward": inside,
        "peak": max(b for _, b in step["samples"]),
        "recompute work": sum(
            e - s for k, _, s, e in step["events"] if k == "recompute"
        ),
        "forward work": sum(e - s for k, _, s, e in step["events"] if k == "forward"),
    }


def mark_block_forwards(model: nn.Module) -> list:
    """Profiler ranges ``block forward (i)`` around each Block's own forward, however
    it is wrapped; a recompute that stops early still closes its range."""
    from torch.autograd.profiler import record_function

    handles = []
    for i, block in enumerate(model.blocks):
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        ranges: list = []

        def pre(module, args, i=i, ranges=ranges):
            ranges.append(record_function(f"block forward ({i})").__enter__())

        def post(module, args, out, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles.append(inner.register_forward_pre_hook(pre))
        handles.append(inner.register_forward_hook(post, always_call=True))
    return handles


_HOOKS = ("pre_forward", "pre_backward", "backward_prefetch", "forward_prefetch")


def hook_sequence(events) -> list[tuple[str, int, str]]:
    """From one rank's profiler events, in time order: ``(what, block, where)`` for
    each block's forward ("forward" before backward, "recompute" in it), each
    all-gather FSDP2 issued for a block (``where``: the FSDP hook that issued it), each
    FSDP2 pre-forward hook that ran in full during backward, and each
    reduce-scatter."""
    import re

    def block(name):
        found = re.search(r"\(blocks\.(\d+)|^block forward \((\d+)\)", name)
        return None if found is None else int(found.group(1) or found.group(2))

    spans = [(e.time_range.start, e.time_range.end, e.name) for e in events]
    backward = min(s for s, _, n in spans if n == "backward")
    out = []
    for start, end, name in sorted(spans):
        i = block(name)
        if i is None:
            continue
        if name.startswith("block forward"):
            out.append(("recompute" if start > backward else "forward", i, ""))
        elif name.startswith("FSDP::all_gather ("):
            around = [
                (s, n) for s, e, n in spans
                if s <= start and end <= e and any(h in n for h in _HOOKS)
            ]  # fmt: skip
            hook = next(h for h in _HOOKS if h in max(around)[1]) if around else "?"
            phase = "backward" if start > backward else "forward"
            out.append(("all-gather", i, f"{hook}, in {phase}"))
        elif name.startswith("FSDP::pre_forward (") and start > backward:
            out.append(("pre-forward hook", i, "in backward"))
        elif name.startswith("FSDP::post_backward_reduce"):
            out.append(("reduce-scatter", i, ""))
    return out
