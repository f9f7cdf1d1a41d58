"""FSDP2 with ``torch.compile``: the checkpoint-compile-shard order and the orders
around it. The experiments of book/fsdp_compile.md.

Every order trains the tiny GPT a few steps on every rank of one launch, with a
``Recorder`` backend (``aot_eager``: Dynamo and AOTAutograd, no code generation, so no
C++ compiler on the CPU) that records each graph it is handed and counts the calls of
each; Dynamo's own counters
give the graph breaks and the frames it gave up on:

    runs = run_ranks(tour, nprocs=2)
    runs[0]["checkpoint, compile, shard"]["graphs"]     # one graph for both blocks

An order that fails comes back as ``{"error": ...}``, not as a failed launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
)
from torch.distributed.fsdp import fully_shard

from distlab.data import token_data
from distlab.infra.experiment import gpt
from distlab.model import GPT, Block
from distlab.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp
from distlab.runtime import rank_world

STEPS = 3
BATCH = 8  # global batch: 4 rows per rank on 2 ranks
BACKEND = "aot_eager"


# --- begin recorder ---
class Recorder:
    """A ``torch.compile`` backend that hands each graph to ``inner`` and records it:
    how many ops and inputs it holds, whether activation checkpointing is inside it, and
    how often it runs."""

    def __init__(self, inner: str = BACKEND):
        self.inner = inner
        self.graphs: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        # the activation and the block's parameters
        inputs = sum(n.op == "placeholder" for n in gm.graph.nodes)
        record = {
            "ops": _ops(gm),
            "inputs": inputs,
            "checkpoint_inside": _has_checkpoint(gm),
            "collectives_inside": _has_collective(gm),
            "calls": 0,
        }
        self.graphs.append(record)
        compiled = lookup_backend(self.inner)(gm, example_inputs)

        def run(*args):
            record["calls"] += 1  # each forward of a block that this graph serves
            return compiled(*args)

        # keep the calling convention Dynamo expects
        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run


# --- end recorder ---


def _ops(gm: torch.fx.GraphModule) -> int:
    """Operator calls in the graph, counting those inside the checkpoint's body once."""
    hop = torch.ops.higher_order.tag_activation_checkpoint
    return sum(
        n.op == "call_function"
        and n.target is not hop
        and "getitem" not in str(n.target)
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
    )


def _has_collective(gm: torch.fx.GraphModule) -> bool:
    """Any c10d or functional-collective op (all-gather, reduce-scatter, ...) in the
    graph or its bodies."""
    graphs = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return any(
        n.op == "call_function" and "c10d" in str(n.target)
        for m in graphs
        for n in m.graph.nodes
    )


def _has_checkpoint(gm: torch.fx.GraphModule) -> bool:
    hop = torch.ops.higher_order.tag_activation_checkpoint
    return any(n.target is hop for n in gm.graph.nodes)


# --- begin orders ---
# --- begin labs steps ---
def checkpoint(model: GPT, backend) -> GPT:
    # each block becomes its CheckpointWrapper
    return apply_activation_checkpointing(model)


def compile_blocks(model: GPT, backend) -> GPT:
    # block.compile(): in place, hooks stay on the block
    return apply_compile(model, backend=backend)


def shard(model: GPT, backend) -> GPT:
    apply_fsdp(model)  # fully_shard on each block, then on the root
    return model


# --- end labs steps ---


def compile_blocks_replacing(model: GPT, backend) -> GPT:
    # torchtitan's apply_compile: an OptimizedModule per block
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend, fullgraph=True)
    return model


def shard_blocks(model: GPT, backend) -> GPT:
    for block in model.blocks:
        fully_shard(block)
    return model


def shard_root(model: GPT, backend) -> GPT:
    fully_shard(model, reshard_after_forward=False)
    return model


ORDERS: dict[str, tuple[Callable, ...]] = {
    "eager": (checkpoint, shard),
    # the labs' order
    "checkpoint, compile, shard": (checkpoint, compile_blocks, shard),
    # torchtitan's
    "checkpoint, compile (replace, fullgraph), shard": (
        checkpoint,
        compile_blocks_replacing,
        shard,
    ),
    "checkpoint, shard, compile": (checkpoint, shard, compile_blocks),
    # then torch.compile(model): see run_order
    "checkpoint, shard, compile the whole model": (checkpoint, shard),
    "shard blocks, checkpoint, compile, shard root": (
        shard_blocks,
        checkpoint,
        compile_blocks,
        shard_root,
    ),
    "shard blocks, checkpoint, compile (replace, fullgraph), shard root": (
        shard_blocks,
        checkpoint,
        compile_blocks_replacing,
        shard_root,
    ),
    "compile, checkpoint, shard": (compile_blocks, checkpoint, shard),
}
# --- end orders ---


def compiled_code_entries() -> dict[str, int]:
    """Compiled entries Dynamo holds for each ``forward`` it may have compiled: one
    entry per set of guards, shared by every module instance whose guards pass."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forwards = {
        "Block.forward": Block.forward,
        "CheckpointWrapper.forward": CheckpointWrapper.forward,
    }
    forwards["GPT.forward"] = GPT.forward
    return {
        name: len(_debug_get_cache_entry_list(fn.__code__))
        for name, fn in forwards.items()
    }


def run_order(name: str, steps: int = STEPS) -> dict:
    """Build the tiny GPT, apply ``ORDERS[name]`` and train ``steps`` steps on
    every rank."""

    def apply(model: GPT, backend) -> nn.Module:
        for step_fn in ORDERS[name]:
            model = step_fn(model, backend)
        return (
            torch.compile(model, backend=backend)
            if name.endswith("whole model")
            else model
        )

    return train_with(apply, steps)


def train_with(apply: Callable[[GPT, Recorder], nn.Module], steps: int = STEPS) -> dict:
    """``apply(model, backend)`` to the tiny GPT, then train ``steps`` steps on every
    rank and report the losses, the graphs the backend was handed, the graph breaks and
    the keys."""
    from torch._dynamo.utils import counters
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    torch._dynamo.reset()  # forget the graphs of the previous order
    counters.clear()
    rank, world_size = rank_world()
    recorder, model = Recorder(), gpt("tiny")
    plain_keys, losses, seconds = list(model.state_dict()), [], []
    try:
        # the model itself, or torch.compile's wrapper of it
        forward = apply(model, recorder)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = token_data()
        for step in range(steps):
            x, y = data.batch(
                "train", step, BATCH, model.config.block_size, 1337, rank, world_size
            )
            start = time.perf_counter()
            loss = forward(x, y)[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
            losses.append(loss.item())
    except Exception as err:  # noqa: BLE001 - the page shows what stopped this order
        return {
            "error": f"{type(err).__name__}: {_first_line(str(err))}",
            "losses": losses,
        }
    breaks = {**counters["graph_break"], **counters["unimplemented"]}
    keys = list(model.state_dict())
    # what DCP saves (TrainingState, parallel.full_state_dict): no `_orig_mod.`
    dcp_keys = list(get_model_state_dict(model))
    return {
        "losses": losses,
        "first_step_s": seconds[0],
        "later_step_s": min(seconds[1:]),
        "graphs": recorder.graphs,
        "graph_breaks": sorted({_first_line(reason) for reason in breaks}),
        "frames_given_up": counters["frames"]["total"] - counters["frames"]["ok"],
        "why_given_up": sorted(
            {_explanation(r) for r in breaks if "Skipping the frame" in r}
        ),
        "entries": compiled_code_entries(),
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        # as model.state_dict() and torch.save name it
        "first_key": next(k for k in keys if k.startswith("blocks.0.")),
        "keys_as_plain_model": keys == plain_keys,
        # as DCP's get_model_state_dict names it
        "dcp_first_key": next(k for k in dcp_keys if k.startswith("blocks.0.")),
        "dcp_keys_as_plain_model": sorted(dcp_keys) == sorted(plain_keys),
    }


def _explanation(reason: str) -> str:
    """The explanation of a frame Dynamo gave up on, up to its first full stop
    after "eager"."""
    line = next(line for line in reason.splitlines() if "Skipping the frame" in line)
    return line.strip().removeprefix("Explanation: ").split(", as ")[0]


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def tour(steps: int = STEPS) -> dict[str, dict]:
    """Every order, in one launch (run on every rank)."""
    return {name: run_order(name, steps) for name in ORDERS}


def check_equal_to_eager(
    runs: dict[str, dict], tolerance: float = 0.0
) -> dict[str, float]:
    """Largest |loss - eager loss| per order that ran (``tolerance`` 0: bit-equal)."""
    eager = runs["eager"]["losses"]
    diffs = {
        name: max(abs(a - b) for a, b in zip(run["losses"], eager))
        for name, run in runs.items()
        if "error" not in run and name != "eager"
    }
    worst = max(diffs.values())
    if worst > tolerance:
        raise AssertionError(
            f"a compiled order's loss differs from eager by {worst:.3g} > "
            f"{tolerance:.3g}"
        )
    return diffs
