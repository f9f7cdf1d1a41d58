"""Accelerate's quiet fallbacks, and what its FSDP2 plugin builds, reproduced on
CPU ranks.

Each function runs on every rank of ``launch.run_ranks(..., init_group=False)``:
Accelerate forms (or fails to form) the process group itself, exactly as it would under
torchrun. They return plain values, so the caller compares the ranks with nothing left
to trust.

``python -m distlab.chapters.accelerate`` prints what one process sees; the chapter runs
it under ``accelerate launch --cpu --num_processes 2`` to count the processes that
command starts.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from distlab.accel import check_processes, check_strategy, strategy_of
from distlab.errors import UserError
from distlab.model import GPT, preset


def fingerprint(model: torch.nn.Module) -> str:
    """A short hash of every parameter's bytes: equal on two ranks iff the weights
    are equal."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def _train(accelerator, model, steps: int = 3) -> torch.nn.Module:
    """A few steps where each rank sees its own rows, as in any data-parallel run. The
    rank comes from the launcher (as the labs' data does), not from Accelerate, which
    may be wrong."""
    vocab_size = model.config.vocab_size  # random tokens of the model's own vocabulary
    model, optimizer = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    rank, T = int(os.environ.get("RANK", 0)), 32
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, vocab_size, (2, T), generator=g)
        _, loss = model(x, x)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return model


def _caught(check, *args, **kwargs) -> str | None:
    """Run one of lab 6's checks; its error message, or None when it passes."""
    try:
        check(*args, **kwargs)
    except UserError as err:
        return str(err)
    return None


def without_cpu_true() -> dict:
    """``Accelerator()`` on a machine with no GPU, in a launched process: a group
    of one."""
    from accelerate import Accelerator

    accelerator = Accelerator()  # the mistake: no cpu=True
    model = _train(accelerator, GPT(preset("tiny"), seed=0))
    # what lab 6 does right after building its Accelerator
    caught = _caught(check_processes, accelerator)
    return {
        "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "strategy": strategy_of(model),
        "weights": fingerprint(model),
        "caught": caught,
    }


def fsdp_plugin_on_cpu() -> dict:
    """``Accelerator(cpu=True, fsdp_plugin=FSDP2)`` on CPU ranks: what does
    prepare give?"""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = _train(accelerator, GPT(preset("tiny"), seed=0))
    # what lab 6 does after prepare
    caught = _caught(check_strategy, model, accelerator, fsdp=True)
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        for p in model.parameters()
    )
    return {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "wrapper": type(model).__name__,
        "strategy": strategy_of(model),
        "parameters_on_this_rank": local,
        "weights": fingerprint(model),
        "caught": caught,
    }


def accumulate_trace(out_dir: str, accum_steps: int = 4) -> None:
    """Under ``notebook_launcher``: for each micro-batch, does Accelerate sync, how many
    gradient all-reduces does DDP send, and does the optimizer really step? Then what
    ``gather_for_metrics`` returns. Each rank writes ``out_dir/rank{i}.json``."""
    import json

    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum_steps)
    cfg = preset("tiny")
    model = GPT(cfg, seed=0)
    model, optimizer = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    sent = []

    # DDP calls this once per gradient bucket it all-reduces
    def counting_hook(state, bucket):
        sent.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    rows, rank = [], accelerator.process_index
    for micro in range(2 * accum_steps):  # two optimizer steps
        x = torch.randint(
            0,
            cfg.vocab_size,
            (2, 32),
            generator=torch.Generator().manual_seed(100 * micro + rank),
        )
        before = fingerprint(model)
        with accelerator.accumulate(model):
            _, loss = model(x, x)
            accelerator.backward(loss)
            optimizer.step()  # called every micro-batch, as in Accelerate's examples
            optimizer.zero_grad()
        rows.append(
            {
                "micro-batch": micro,
                "sync_gradients": accelerator.sync_gradients,
                "all-reduces": len(sent),
                "bytes all-reduced": sum(sent),
                "weights changed": fingerprint(model) != before,
            }
        )
        sent.clear()
    mine = torch.tensor([10.0 * rank, 10.0 * rank + 1])
    gathered = accelerator.gather_for_metrics(mine).tolist()
    mean = accelerator.reduce(mine, "mean").tolist()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "mine": mine.tolist(),
                "gathered": gathered,
                "reduced_mean": mean,
            }
        )
    )


def in_fsdp2_mode(plugin, mixed_precision: str):
    """A CPU Accelerator switched into the FSDP2 mode that Accelerate selects only
    on accelerators.

    Given an FSDP plugin on GPUs, ``AcceleratorState.__init__`` (accelerate/state.py)
    sets ``distributed_type = FSDP``, calls
    ``plugin.set_mixed_precision(mixed_precision)`` unless it is "no", keeps the plugin,
    and copies ``distributed_type`` into ``PartialState``. Doing the same here makes
    ``prepare``, ``accumulate`` and ``no_sync`` run Accelerate's own FSDP2 code
    (accelerate/utils/fsdp_utils.py) on gloo ranks.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    # a fresh Accelerator per setup; the process group stays
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=2
    )
    accelerator.state.distributed_type = DistributedType.FSDP
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    # every AcceleratorState() reads it
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    assert accelerator.is_fsdp2
    return accelerator


def _unit_chain(module) -> str:
    """``FSDP[0](CheckpointWrapper(FSDP[12](Block)))``: the wrappers from a block down
    to the ``Block``; FSDP[n] is an FSDP2 unit and n the parameters it all-gathers and
    reduce-scatters."""
    from torch.distributed.fsdp import FSDPModule

    parts = []
    while module is not None:
        name = type(module).__name__
        # fully_shard swaps the class for FSDP<class>
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            parts.append(f"FSDP[{len(group.fsdp_params) if group else 0}]")
            name = name.removeprefix("FSDP")
        parts.append(name)
        module = getattr(module, "_checkpoint_wrapped_module", None)
    return "(".join(parts) + ")" * (len(parts) - 1)


def _fsdp2_setup(name: str) -> tuple:
    """The plugin, Accelerate's ``mixed_precision`` and what lab code runs before
    ``prepare``."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from distlab.accel import fsdp2_plugin, mixed_precision_for

    wrap = {
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["Block"],
    }
    if name == "checkpoint, then the plugin wraps Block":  # lab 6 before
        return (
            FullyShardedDataParallelPlugin(fsdp_version=2, **wrap),
            "bf16",
            True,
            False,
        )
    if name == "the plugin checkpoints and wraps Block, explicit policy":
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            activation_checkpointing=True,
            mixed_precision_policy=policy,
            **wrap,
        )
        return plugin, "bf16", False, False
    if name == "checkpoint, then the plugin wraps CheckpointWrapper":
        wrap["transformer_cls_names_to_wrap"] = ["CheckpointWrapper"]
        return (
            FullyShardedDataParallelPlugin(fsdp_version=2, **wrap),
            "bf16",
            True,
            False,
        )
    if name == "lab 6: checkpoint, apply_fsdp, then prepare":
        return fsdp2_plugin(), mixed_precision_for("bf16", fsdp=True), True, True
    raise ValueError(f"unknown setup {name!r}")


FSDP2_SETUPS = (
    "checkpoint, then the plugin wraps Block",
    "the plugin checkpoints and wraps Block, explicit policy",
    "checkpoint, then the plugin wraps CheckpointWrapper",
    "lab 6: checkpoint, apply_fsdp, then prepare",
)


def _step_in_fsdp2_mode(name: str) -> dict:
    """One setup of ``fsdp2_setups`` on this rank."""
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from distlab.parallel import apply_activation_checkpointing, apply_fsdp

    plugin, mixed_precision, checkpoint_first, shard_first = _fsdp2_setup(name)
    accelerator = in_fsdp2_mode(plugin, mixed_precision)
    model = GPT(preset("tiny"), seed=0)
    if checkpoint_first:
        model = apply_activation_checkpointing(model, "full")
    if shard_first:
        model = apply_fsdp(model, param_dtype=torch.bfloat16)
    model, optimizer = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    reduced, losses, original = [[], []], [], dist.reduce_scatter_single

    def counted(*args, **kwargs):  # FSDP2 reduce-scatters gradients with this call
        reduced[len(losses)].append(str(kwargs["input"].dtype).removeprefix("torch."))
        return original(*args, **kwargs)

    gen = torch.Generator().manual_seed(dist.get_rank())
    with mock.patch.object(dist, "reduce_scatter_single", counted):
        # accumulate counts 2 micro-batches per step: sync on the second only
        for _ in range(2):
            x = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
            with accelerator.accumulate(model):
                _, loss = model(x, x)
                accelerator.backward(loss)
            losses.append(loss)
    # the root's: every unit gets the same policy
    policy = model._get_fsdp_state()._mp_policy
    return {
        "setup": name,
        "block 0 after prepare": _unit_chain(model.blocks[0]),
        "units": [
            n or "root" for n, m in model.named_modules() if isinstance(m, FSDPModule)
        ],
        "policy": ", ".join(
            f"{k} {_short(getattr(policy, k))}" for k in _POLICY_FIELDS
        ),
        "loss dtype": _short(losses[0].dtype),
        "reduce-scatters per micro-batch": [len(r) for r in reduced],
        "reduce-scatter dtypes": sorted(set(reduced[0] + reduced[1])),
        "grad_norm": float(
            accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        ),
    }


_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")


def _short(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fsdp2_setups(setups=FSDP2_SETUPS) -> list[dict]:
    """For each setup, on CPU ranks in Accelerate's FSDP2 mode: ``prepare`` the tiny GPT
    with bf16, then one step of 2 micro-batches under ``accumulate``. What trains: the
    wrappers around block 0, the policy on its units, the dtypes of the loss and of each
    reduce-scatter (counted per micro-batch), and the gradient norm."""
    return [_step_in_fsdp2_mode(name) for name in setups]


if __name__ == "__main__":
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    print(
        f"process {accelerator.process_index} of {accelerator.num_processes} "
        f"({accelerator.distributed_type}); WORLD_SIZE={os.environ.get('WORLD_SIZE')}",
        flush=True,
    )
