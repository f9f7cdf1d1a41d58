"""DDP's flags measured against its defaults, and the cases each one enables or breaks.

The experiments of book/ddp_tuning.md (its first half; the batch and learning-rate runs
are in ``distlab.tools.lr_scaling``). Everything here runs on every rank of a
``run_ranks`` launch (``flag_costs``) or of an ``observe`` launch
(``run_case``/``run_cases``, whose cases may fail on purpose and then return the error
they caught).

Collectives are counted with ``CommDebugMode`` (``torch.distributed.tensor.debug``): it
is a ``TorchDispatchMode`` and sees the c10d ops (``allreduce_``, ``broadcast_``) that
DDP's C++ ``Reducer`` issues, as ``distlab.chapters.ddp_in_practice`` does too. Peak
bytes come from ``distlab.memory.StepMemory``: PyTorch's ``MemTracker``, the tracker
``bucket_view_costs`` of ``ddp_internals`` uses, through the labs' wrapper, watching the
second step (where DDP allocates its rebuilt buckets).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
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

# the settings compared, each against DDP's defaults (find_unused_parameters=False,
# static_graph=False, gradient_as_bucket_view=False)
FLAGS: dict[str, dict] = {
    "defaults": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
}
# the first steps, whose collectives are counted (and not timed: counting slows them)
COUNTED_STEPS = 3


def short_op(op) -> str:
    """``c10d.allreduce_.default`` -> ``allreduce``."""
    return str(op).split(".")[-2 if str(op).endswith(".default") else -1].rstrip("_")


# --- begin flag-costs ---
def flag_costs(steps: int = 10, batch: int = 4, set_to_none: bool = False) -> dict:
    """On every rank: the tiny GPT under DDP(**flags) for each of FLAGS, ``steps`` AdamW
    steps of ``batch`` x 64 tokens per rank, the settings taking turns step by step (so
    a slow spell of the shared machine hits them all). For each: the collectives of each
    of the first COUNTED_STEPS steps, the median seconds of the forward and of the whole
    step over the others, and the peak bytes of tensors in step 2."""
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
            "forward_s": [],
            "step_s": [],
        }
    block_size = next(iter(runs.values()))["model"].config.block_size
    for step in range(steps):
        x, y = data.batch(
            "train", step, batch * world_size, block_size, 1337, rank, world_size
        )
        for run in runs.values():
            counting = step < COUNTED_STEPS
            run["memory"].begin()
            with CommDebugMode() if counting else contextlib.nullcontext() as comms:
                start = time.perf_counter()
                # find_unused_parameters walks the autograd graph at its end
                loss = run["ddp"](x, y)[1]
                forward_end = time.perf_counter()
                loss.backward()
                run["optimizer"].step()
            run["optimizer"].zero_grad(set_to_none=set_to_none)
            end = time.perf_counter()
            run["memory"].end()
            if counting:
                run["collectives"].append(
                    {short_op(op): n for op, n in comms.get_comm_counts().items()}
                )
            else:
                run["forward_s"].append(forward_end - start)
                run["step_s"].append(end - start)
            run["loss"] = loss.item()
    return {
        name: {
            "collectives": run["collectives"],
            "forward_ms": 1e3 * statistics.median(run["forward_s"]),
            "step_ms": 1e3 * statistics.median(run["step_s"]),
            "timed_steps": len(run["step_s"]),
            "peak_bytes": run["memory"].peak["total"],
            "grad_bytes": sum(
                p.numel() * p.element_size() for p in run["model"].parameters()
            ),
            "loss": run["loss"],
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


def run_cases(report: str, names: list[str] | None = None) -> dict:
    """On every rank: ``run_case`` for each of CASES (or those named), one after the
    other in one launch, then ``twice_with_a_bucket_pending`` (under the key
    ``"pending"``). A failed case leaves no collective behind (the Reducer raises before
    issuing one, the same on every rank), so the next case's DDP starts clean."""
    results = {name: run_case(report, *CASES[name]) for name in names or CASES}
    return results | {"pending": twice_with_a_bucket_pending(report)}


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


def first_line(error: str | None) -> str:
    """The error's first line, cut at 200 characters ("no error" for None)."""
    if error is None:
        return "no error"
    line = error.splitlines()[0]
    return line if len(line) < 200 else line[:197] + "..."
