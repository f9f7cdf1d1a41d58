"""DDP's flags measured against its defaults, and the cases each one enables or breaks.

The experiments of book/ddp_tuning.md (the learning-rate rules and their runs are in
``distlab.tools.lr_scaling``). The page launches 2 ranks once, through ``observe``
(its cases fail on purpose and return the error they caught):

    outcome = observe(two_rank_runs, pg_timeout=30)
    outcome.results[0]["costs"], ["scaling"], ["cases"]

Collectives are counted with ``CommDebugMode`` (``torch.distributed.tensor.debug``): it
is a ``TorchDispatchMode`` and sees the c10d ops (``allreduce_``, ``broadcast_``) that
DDP's C++ ``Reducer`` issues, as ``distlab.chapters.ddp_in_practice`` does too. Peak
bytes come from ``distlab.memory.StepMemory``: PyTorch's ``MemTracker``, the tracker
``bucket_view_costs`` of ``ddp_internals`` uses, through the labs' wrapper, watching the
second step (where DDP allocates its rebuilt buckets).
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from distlab.data import token_data
from distlab.infra.observe import caught
from distlab.memory import StepMemory
from distlab.model import GPT, preset
from distlab.runtime import rank_world
from distlab.tools.lr_scaling import scaling_runs

# the settings compared, each against DDP's defaults (find_unused_parameters=False,
# static_graph=False, gradient_as_bucket_view=False)
FLAGS: dict[str, dict] = {
    "defaults": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
}
# the first steps, whose collectives are counted (the bucket rebuilds happen in them)
COUNTED_STEPS = 3


def short_op(op) -> str:
    """``c10d.allreduce_.default`` -> ``allreduce``."""
    return str(op).split(".")[-2 if str(op).endswith(".default") else -1].rstrip("_")


# --- begin flag-costs ---
def flag_costs(steps: int = COUNTED_STEPS, batch: int = 1) -> dict:
    """On every rank: the tiny GPT under DDP(**flags) for each of FLAGS, ``steps``
    AdamW steps of ``batch`` x 64 tokens per rank, the settings taking turns step by
    step. For each: the collectives of every step, the peak bytes of tensors in step 2,
    and the final loss."""
    rank, world_size = rank_world()
    data = token_data()
    runs = {}
    for name, flags in FLAGS.items():
        model = GPT(preset("tiny", vocab_size=data.vocab_size), seed=1337)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = {
            "model": model,
            "ddp": DDP(model, **flags),
            "optimizer": optimizer,
            # watches the second step it is told of
            "memory": StepMemory(model, optimizer),
            "collectives": [],
        }
    block_size = next(iter(runs.values()))["model"].config.block_size
    for step in range(steps):
        x, y = data.batch(
            "train", step, batch * world_size, block_size, 1337, rank, world_size
        )
        for run in runs.values():
            run["memory"].begin()
            with CommDebugMode() as comms:
                # find_unused_parameters walks the autograd graph at its end
                loss = run["ddp"](x, y)[1]
                loss.backward()
            run["optimizer"].step()
            # kept: the next forward runs with last step's gradients alive
            run["optimizer"].zero_grad(set_to_none=False)
            run["memory"].end()
            counts = comms.get_comm_counts().items()
            run["collectives"].append({short_op(op): n for op, n in counts})
            run["loss"] = loss.item()
    return {
        name: {
            "collectives": run["collectives"],
            "peak_bytes": run["memory"].peak["total"],
            "grad_bytes": sum(
                p.numel() * p.element_size() for p in run["model"].parameters()
            ),
            "loss": run["loss"],
            # what the static_graph docstring says to read
            "logged": {
                k: v
                for k, v in run["ddp"]._get_ddp_logging_data().items()
                if "static_graph" in k
            },
        }
        for name, run in runs.items()
    }


# --- end flag-costs ---


# ---------------------------------------------------------------- the cases
class TwoLayers(nn.Module):
    """``a`` then ``b``; ``a`` twice through reentrant checkpointing, or ``b`` skipped,
    on request."""

    def __init__(self):
        super().__init__()
        # the same weights on every rank and in the one-process reference
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(
        self, x: torch.Tensor, twice: bool = False, use_b: bool = True
    ) -> torch.Tensor:
        h = self.a(x)
        # ``a`` again, inside a reentrant checkpoint: its backward is a backward of
        # its own
        if twice:
            h = checkpoint(self.a, torch.relu(h), use_reentrant=True)
        return self.b(torch.relu(h)) if use_b else h.sum(1, keepdim=True)


class BehindAnotherLayer(TwoLayers):
    """``c`` before ``a``, which is then used twice as in TwoLayers: ``c``'s gradient
    comes last."""

    def __init__(self):
        super().__init__()
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.relu(self.c(x)), twice=True)


def case_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * step + rank)
    # (4, 4), (4, 1)
    return torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            torch.zeros(p.numel()) if p.grad is None else p.grad.flatten()
            for p in model.parameters()
        ]
    )


# --- begin cases ---
def run_case(
    report: str, flags: dict, twice: bool = False, use_b: list[bool] | None = None
) -> dict:
    """On every rank: 3 backward passes of TwoLayers under DDP(**flags); ``use_b[i]``:
    whether step i uses layer ``b``. The averaged gradients of each step, or the error
    that stopped it."""
    rank, _ = rank_world()
    use_b = use_b or [True] * 3
    model = TwoLayers()
    ddp = DDP(model, **flags)
    grads = []
    with caught(report) as failed:
        for step, with_b in enumerate(use_b):
            model.zero_grad(set_to_none=True)
            x, y = case_batch(step, rank)
            F.mse_loss(ddp(x, twice=twice, use_b=with_b), y).backward()
            grads.append(flat_grads(model))
    return {"grads": grads, "error": failed.error, "waited_s": failed.waited_s}


# name: (DDP flags, ``a`` used twice, whether step i uses ``b``)
CASES: dict[str, tuple] = {
    "a twice, defaults": ({}, True, None),
    "a twice, find_unused_parameters": ({"find_unused_parameters": True}, True, None),
    "a twice, static_graph": ({"static_graph": True}, True, None),
    "b unused, static_graph": ({"static_graph": True}, False, [False] * 3),
    "b used, then not, static_graph": (
        {"static_graph": True},
        False,
        [True, False, False],
    ),
    "b unused, then used, static_graph": (
        {"static_graph": True},
        False,
        [False, True, True],
    ),
    "b used, not, used, find_unused_parameters": (
        {"find_unused_parameters": True},
        False,
        [True, False, True],
    ),
}


def twice_with_a_bucket_pending(report: str) -> str | None:
    """``a`` twice under the defaults, but with ``c``'s gradient still to come when the
    checkpoint's backward ends: the error DDP raises, or None."""
    ddp = DDP(BehindAnotherLayer())
    with caught(report) as failed:
        x, y = case_batch(0, rank_world()[0])
        F.mse_loss(ddp(x), y).backward()
    return failed.error


def static_graph_with_no_sync(report: str) -> str | None:
    """Gradient accumulation under static_graph=True: the first micro-batch's backward
    inside ``no_sync()``, the second synced. The error DDP raises, or None."""
    model = TwoLayers()
    ddp = DDP(model, static_graph=True)
    rank = rank_world()[0]
    with caught(report) as failed:
        for micro in range(2):
            x, y = case_batch(micro, rank)
            sync = contextlib.nullcontext() if micro else ddp.no_sync()
            with sync:
                F.mse_loss(ddp(x), y).backward()
    return failed.error


def unused_with_names(report: str) -> str | None:
    """``b`` unused under the defaults, with TORCH_DISTRIBUTED_DEBUG=DETAIL: the error
    of the second forward, which then names the parameters."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # DDP reads the level when it is built
    try:
        model = TwoLayers()
        ddp = DDP(model)
        rank = rank_world()[0]
        with caught(report) as failed:
            for step in range(2):
                x, y = case_batch(step, rank)
                F.mse_loss(ddp(x, use_b=False), y).backward()
    finally:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "OFF"
        dist.set_debug_level_from_env()
    return failed.error


def run_cases(report: str, names: list[str] | None = None) -> dict:
    """On every rank: ``run_case`` for each of CASES (or those named), one after the
    other in one launch, then the three single demos (keys ``"pending"``,
    ``"unused named"``, ``"no_sync"``). A failed case leaves no collective behind (the
    Reducer raises before issuing one, the same on every rank), so the next case's DDP
    starts clean."""
    results = {name: run_case(report, *CASES[name]) for name in names or CASES}
    return results | {
        "pending": twice_with_a_bucket_pending(report),
        "unused named": unused_with_names(report),
        "no_sync": static_graph_with_no_sync(report),
    }


# --- end cases ---


def case_reference(
    world_size: int = 2, twice: bool = False, use_b: list[bool] | None = None
) -> list[torch.Tensor]:
    """One process: each step's gradient of the mean of the ranks' losses
    (DDP's average)."""
    model = TwoLayers()
    grads = []
    for step, with_b in enumerate(use_b or [True] * 3):
        model.zero_grad(set_to_none=True)
        loss = sum(
            F.mse_loss(
                model(*case_batch(step, r)[:1], twice, with_b), case_batch(step, r)[1]
            )
            for r in range(world_size)
        )
        (loss / world_size).backward()
        grads.append(flat_grads(model))
    return grads


def two_rank_runs(report: str) -> dict:
    """Everything the page runs on 2 ranks, in one launch: the flag costs, the
    learning-rate runs at 2 ranks, then the cases (last: some fail on purpose)."""
    return {
        "costs": flag_costs(),
        "scaling": scaling_runs(),
        "cases": run_cases(report),
    }


def _two_lines(name: str) -> str:
    """A long flag name broken at the underscore nearest its middle."""
    if len(name) < 14:
        return name
    cuts = [i for i, c in enumerate(name) if c == "_"]
    cut = min(cuts, key=lambda i: abs(i - len(name) / 2))
    return name[: cut + 1] + "\n" + name[cut + 1 :]


def collectives_figure(costs: dict):
    """The collectives counted in each of the first steps, per setting: a grid, one row
    per setting, one column per step."""
    import matplotlib.pyplot as plt

    names = list(costs)
    steps = len(costs[names[0]]["collectives"])
    fig, ax = plt.subplots(figsize=(6.4, 0.6 + 0.8 * len(names)))
    for i, name in enumerate(names):
        for j, counted in enumerate(costs[name]["collectives"]):
            total = sum(counted.values())
            ax.add_patch(
                plt.Rectangle((j, i), 0.96, 0.9, color=plt.cm.Blues(0.15 + 0.2 * total))
            )
            text = "\n".join(
                f"{n} {op.replace('allreduce', 'all-reduce')}{'s' * (n > 1)}"
                for op, n in sorted(counted.items(), reverse=True)
            )
            ax.text(j + 0.48, i + 0.45, text, ha="center", va="center", fontsize=11)
    ax.set_xlim(0, steps)
    ax.set_ylim(len(names), 0)
    ax.set_xticks(
        [j + 0.48 for j in range(steps)], [f"step {j + 1}" for j in range(steps)]
    )
    ax.set_yticks([i + 0.45 for i in range(len(names))], map(_two_lines, names))
    ax.tick_params(length=0, labelsize=11)
    ax.xaxis.tick_top()
    for side in ax.spines.values():
        side.set_visible(False)
    fig.tight_layout()
    return fig


# name -> what it does, in one line (defaults are read from the installed signature)
FLAG_NOTES = {
    "find_unused_parameters": "walks the graph after each forward",
    "static_graph": "records step 1's graph, then trusts it",
    "gradient_as_bucket_view": ".grad are views into the buckets",
    "bucket_cap_mb": "bucket size, MiB (None: 25)",
    "bucket_cap_mb_list": "one cap per bucket, from step 1",
    "batched_grad_copy": "one _foreach_copy_ per bucket",
    "skip_all_reduce_unused_params": "skips params unused on all ranks, always",
    "init_sync": "checks shapes, broadcasts rank 0's state",
    "forward_sync_buffers": "syncs buffers each forward (None: True)",
    "broadcast_buffers": "deprecated in 2.13 for the above",
}


def flag_table() -> list[tuple[str, object, str]]:
    """(flag, its default in the installed DDP, what it does) for FLAG_NOTES."""
    signature = inspect.signature(DDP.__init__).parameters
    return [(name, signature[name].default, note) for name, note in FLAG_NOTES.items()]


def first_line(error: str | None) -> str:
    """The error's first line, cut at 200 characters ("no error" for None)."""
    if error is None:
        return "no error"
    line = error.splitlines()[0]
    return line if len(line) < 200 else line[:197] + "..."
