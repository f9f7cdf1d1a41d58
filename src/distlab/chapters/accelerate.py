"""Accelerate's quiet fallbacks, reproduced on CPU ranks for the chapter and the tests.

Each function runs on every rank of ``launch.run_ranks(..., init_group=False)``: Accelerate
forms (or fails to form) the process group itself, exactly as it would under torchrun.
They return plain values, so the caller compares the ranks with nothing left to trust.

``python -m distlab.chapters.accelerate`` prints what one process sees; the chapter runs it under
``accelerate launch --cpu --num_processes 2`` to count the processes that command starts.
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
    """A short hash of every parameter's bytes: equal on two ranks iff the weights are equal."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def _train(accelerator, model, steps: int = 3) -> torch.nn.Module:
    """A few steps where each rank sees its own rows, as in any data-parallel run. The rank
    comes from the launcher (as the labs' data does), not from Accelerate, which may be wrong."""
    vocab_size = model.config.vocab_size  # random tokens of the model's own vocabulary
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
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
    """``Accelerator()`` on a machine with no GPU, in a launched process: a group of one."""
    from accelerate import Accelerator

    accelerator = Accelerator()  # the mistake: no cpu=True
    model = _train(accelerator, GPT(preset("tiny"), seed=0))
    caught = _caught(check_processes, accelerator)  # what lab 6 does right after building its Accelerator
    return {
        "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "strategy": strategy_of(model),
        "weights": fingerprint(model),
        "caught": caught,
    }


def fsdp_plugin_on_cpu() -> dict:
    """``Accelerator(cpu=True, fsdp_plugin=FSDP2)`` on CPU ranks: what does prepare give?"""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = _train(accelerator, GPT(preset("tiny"), seed=0))
    caught = _caught(check_strategy, model, accelerator, fsdp=True)  # what lab 6 does after prepare
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
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
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sent = []

    def counting_hook(state, bucket):  # DDP calls this once per gradient bucket it all-reduces
        sent.append(bucket.buffer().numel())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    rows, rank = [], accelerator.process_index
    for micro in range(2 * accum_steps):  # two optimizer steps
        x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(100 * micro + rank))
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
                "weights changed": fingerprint(model) != before,
            }
        )
        sent.clear()
    mine = torch.tensor([10.0 * rank, 10.0 * rank + 1])
    gathered = accelerator.gather_for_metrics(mine).tolist()
    mean = accelerator.reduce(mine, "mean").tolist()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"rows": rows, "mine": mine.tolist(), "gathered": gathered, "reduced_mean": mean})
    )


if __name__ == "__main__":
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    print(
        f"process {accelerator.process_index} of {accelerator.num_processes} "
        f"({accelerator.distributed_type}); WORLD_SIZE={os.environ.get('WORLD_SIZE')}",
        flush=True,
    )
