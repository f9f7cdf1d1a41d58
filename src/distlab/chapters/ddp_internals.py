"""The DDP chapter's experiments: each data-parallel wrapper trained on equal terms, the
gradients each one leaves after the sync, and what torch's DDP really does inside.

Called on every rank (through ``distlab.infra.launch.run_ranks``) or in a
single process:

    # from-scratch DDP on 2 ranks
    run_ranks(train_steps, nprocs=2, args=("ddp-bucketed",))
    # the one-process reference
    train_steps("single")
    # the real Reducer's buckets
    run_ranks(bucket_layouts, nprocs=2)
    # everything the page shows from 2 ranks, in one launch
    run_ranks(page_runs, nprocs=2)

Strategies (``STRATEGIES``, names from ``distlab.infra.experiment``): ``single`` (no
wrapper; one process), ``ddp`` (torch's DistributedDataParallel) and the from-scratch
``ddp-naive``, ``ddp-hooks`` and ``ddp-bucketed`` of ``distlab.scratch.ddp``.

The Reducer (DDP's C++ half) is read through what torch 2.13 lets Python see: its
buckets (``reducer._get_zeros_like_grad_buckets()``, one ``GradBucket`` each, a private
API), DDP's logging data (``_get_ddp_logging_data()``), and the aten ops it issues,
which a ``TorchDispatchMode`` sees like any others.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.infra.experiment import WrapOptions, build, train
from distlab.memory import tracker_snapshot
from distlab.model import GPT, preset
from distlab.parallel import apply_ddp
from distlab.runtime import dist_env, pick_device
from distlab.tools.comm_timeline import Timeline, timestamping_hook
from distlab.tools.ddp_compile import ddp_optimizer_report

FROM_SCRATCH = ("ddp-naive", "ddp-hooks", "ddp-bucketed")
STRATEGIES = ("single", "ddp", *FROM_SCRATCH)


def train_steps(
    strategy: str,
    preset_name: str = "tiny",
    steps: int = 10,
    global_batch: int = 16,
    seed: int = 1337,
    bucket_cap_mb: float | None = None,
    lr: float = 1e-3,
) -> dict:
    """``steps`` AdamW steps; the global mean loss of each step, its seconds and
    tokens/s. ``bucket_cap_mb`` None leaves each wrapper's default."""
    return train(
        strategy,
        preset_name,
        steps,
        global_batch,
        seed,
        lr,
        options=WrapOptions(bucket_cap_mb=bucket_cap_mb),
    )


def gradients(
    strategy: str,
    preset_name: str = "tiny",
    global_batch: int = 16,
    seed: int = 1337,
    bucket_cap_mb: float | None = None,
) -> list[torch.Tensor]:
    """Every parameter's gradient after one forward/backward and the gradient sync."""
    exp = build(
        strategy,
        preset_name,
        global_batch,
        seed,
        options=WrapOptions(bucket_cap_mb=bucket_cap_mb),
    )
    exp.backward(exp.loss(0))
    return [p.grad.detach().cpu().clone() for p in exp.model.parameters()]


class AtenOps(TorchDispatchMode):
    """Counts the aten ops run inside the block, C++ callers included (DDP's Reducer
    issues its gradient copies through the dispatcher), and keeps the scalar factor of
    each ``mul.out``."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.mul_factors: set[float] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        # tensor * a Python number
        if func is torch.ops.aten.mul.out and isinstance(args[1], float):
            self.mul_factors.add(args[1])
        return func(*args, **(kwargs or {}))


def _device() -> torch.device:
    return pick_device("auto", dist_env()[1])


def _ddp(model: nn.Module, bucket_cap_mb: float | None = None, **kwargs):
    """torch DDP around ``model`` (moved to this rank's device); ``bucket_cap_mb`` only
    if given, since passing it, even as 25, turns the 1 MiB first bucket off."""
    device = _device()
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    return apply_ddp(model.to(device), device, **kwargs)


# --- begin layouts ---
def reducer_buckets(ddp) -> list[tuple[int, list[str]]]:
    """The Reducer's buckets now, in the order it launches them: (bytes,
    parameter names)."""
    names = {id(p): name for name, p in ddp.module.named_parameters()}
    return [
        (
            b.buffer().numel() * b.buffer().element_size(),
            [names[id(p)] for p in b.parameters()],
        )
        for b in ddp.reducer._get_zeros_like_grad_buckets()
    ]


# --- end layouts ---


def bucket_layouts(
    preset_name: str = "tiny",
    bucket_cap_mb: float | None = None,
    tokens: int = 16,
    **ddp_kwargs,
) -> dict:
    """On every rank: torch DDP's buckets when it is built, after the first backward,
    and from the second forward on; the order in which the first backward made the
    gradients ready; and each backward's events, gradients ready and buckets launched
    in the order they happened (``distlab.tools.bucket_firing`` draws them)."""
    model = GPT(preset(preset_name))
    ddp = _ddp(model, bucket_cap_mb, **ddp_kwargs)
    timeline = Timeline()  # records in order; its comm hook all-reduces as DDP does
    ddp.register_comm_hook(timeline, timestamping_hook)
    timeline.watch_gradients(model)
    names = [name for name, _ in model.named_parameters()]  # the Reducer's indices
    x = torch.randint(0, model.config.vocab_size, (1, tokens), device=_device())
    layouts, backwards = {"built": reducer_buckets(ddp)}, []
    for step in range(2):
        timeline.clear()
        loss = ddp(x, x)[1]  # the second forward first rebuilds the buckets
        if step:
            layouts["from forward 2 on"] = reducer_buckets(ddp)
        loss.backward()
        if not step:
            layouts["after backward 1"] = reducer_buckets(ddp)
        events = [(w, names[i] if w == "grad" else i) for w, i, _ in timeline.events]
        backwards.append(
            {
                "events": [e for e in events if e[0] in ("grad", "launch")],
                "buckets": reducer_buckets(ddp),
            }
        )
    # logged by the second forward, so it is the first backward's order
    ready = ddp._get_ddp_logging_data()["prev_iteration_grad_ready_order_indices"]
    return {
        "layouts": layouts,
        "backwards": backwards,
        "ready_order": [names[int(i)] for i in ready.split(",")],
        "parameters": names,
        "bytes": {n: p.numel() * p.element_size() for n, p in model.named_parameters()},
    }


def gradient_when_backward_returns() -> dict:
    """On every rank: the tied embedding's gradient as a hook sees it inside backward
    (it is the last gradient the tiny GPT's backward produces) and as ``backward()``
    leaves it."""
    exp = build("ddp")
    inside = []
    exp.model.wte.weight.register_post_accumulate_grad_hook(
        lambda p: inside.append(p.grad.clone())
    )
    exp.loss(0).backward()  # nothing else: no call after it
    return {
        "inside backward": inside[0],
        "after backward": exp.model.wte.weight.grad.clone(),
    }


def predivision(global_batch: int = 12) -> dict:
    """On every rank: torch DDP's averaged gradients; NaiveDDP's (an all-reduce per
    tensor: sum, then divide by N); the same all-reduces of gradients multiplied by 1/N
    first; and the factors by which DDP's Reducer multiplies the gradients it copies
    into its buckets."""
    with AtenOps() as ops:
        ddp = gradients("ddp", global_batch=global_batch)
    naive = gradients("ddp-naive", global_batch=global_batch)
    exp = build("ddp-naive", global_batch=global_batch)
    exp.loss(0).backward()  # no finish_gradient_sync: the all-reduces below replace it
    for p in exp.model.parameters():
        p.grad.mul_(1 / exp.world_size)  # as DDP does, and then only the sum
        dist.all_reduce(p.grad)
    predivided = [p.grad.detach().cpu().clone() for p in exp.model.parameters()]
    return {
        "ddp": ddp,
        "naive": naive,
        "naive_predivided": predivided,
        "factors": sorted(ops.mul_factors),
    }


def ulps_of_largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |a - b| over every tensor pair, in ulps of that tensor's largest |b|
    (1 ulp: the gap between two neighbouring floats of that size)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        top = y.abs().max()
        worst = max(
            worst, ((x - y).abs().max() / (torch.nextafter(top, top + 1) - top)).item()
        )
    return worst


# --- begin bucket-view ---
def bucket_view_costs(
    as_view: bool, set_to_none: bool, batch: int = 4, tokens: int = 64, steps: int = 3
) -> dict:
    """On every rank: what DDP does with each gradient in a backward after its buckets
    are rebuilt, and the peak bytes of tensors from the second iteration on (PyTorch's
    MemTracker, entered before the forward in which DDP allocates its rebuilt buckets,
    so it sees them)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = GPT(preset("tiny"))
    ddp = _ddp(model, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.AdamW(model.parameters())
    gen = torch.Generator().manual_seed(0)
    tracker, ops = MemTracker(), AtenOps()
    tracker.track_external(model, optimizer)
    for step in range(steps):
        x = torch.randint(
            0, model.config.vocab_size, (batch, tokens), generator=gen
        ).to(_device())
        if step == 1:
            tracker.__enter__()
        if step >= 1:
            # the tracker refuses a second forward of a module it watched
            tracker.reset_mod_stats()
        loss = ddp(x, x)[1]
        if step == steps - 1:
            with ops:
                loss.backward()
        else:
            loss.backward()
        grad_storages = {
            p.grad.untyped_storage().data_ptr() for p in model.parameters()
        }
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    tracker.__exit__(None, None, None)
    # the model's device: AdamW's step counters sit on the CPU
    peak = tracker_snapshot(tracker, "peak", _device())
    return {
        "copies into the bucket (x 1/N)": ops.counts["aten.mul.out"],
        "in-place divisions in the bucket": ops.counts["aten.div_.Scalar"],
        "copies back to .grad": ops.counts["aten.copy_.default"],
        "gradient storages": len(grad_storages),
        "peak_bytes": int(peak["Total"]),
    }


# --- end bucket-view ---


def compiled_ddp(
    n_embd: int | None = None,
    bucket_cap_mb: float | None = None,
    compile_first: bool = False,
) -> dict:
    """On every rank: ``torch.compile(DDP(gpt))`` (or ``DDP(torch.compile(gpt))``), two
    steps, as ``distlab.tools.ddp_compile.ddp_optimizer_report`` reports them."""
    model = GPT(preset("tiny", **({"n_embd": n_embd} if n_embd else {})))
    x = torch.randint(0, model.config.vocab_size, (2, 32), device=_device())
    return ddp_optimizer_report(
        model, lambda m: _ddp(m, bucket_cap_mb), lambda m: m(x, x)[1], compile_first
    )


# ------------------------------------------------ the page's one launch of 2 ranks
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)  # self.unused takes no part


def unused_parameter(wrap) -> str:
    """Two steps of ``wrap(model)`` where one layer gets no gradient: "two steps done",
    or the first line of the error that stopped them. Neither wrapper launches the
    stalled bucket, so the group is still in step for what follows."""
    from distlab.scratch.ddp import BucketedDDP

    model = wrap(_Branchy().to(_device()))
    try:
        for _ in range(2):
            model(torch.randn(2, 4, device=_device())).sum().backward()
            if isinstance(model, BucketedDDP):
                model.finish_gradient_sync()
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return "two steps done"


def autocast_bucket_dtypes() -> list[str]:
    """The dtypes of torch DDP's buckets after a backward under bf16 autocast."""
    ddp = _ddp(GPT(preset("tiny")))
    x = torch.randint(0, 65, (1, 16), device=_device())
    with torch.autocast(_device().type, dtype=torch.bfloat16):
        loss = ddp(x, x)[1]
    loss.backward()
    return sorted(
        {str(b.buffer().dtype) for b in ddp.reducer._get_zeros_like_grad_buckets()}
    )


def page_runs(steps: int = 5) -> dict:
    """On each of 2 ranks, every experiment of book/ddp_internals.md but the 3-rank
    division, in one launch to save process start-ups."""
    from distlab.scratch.ddp import BucketedDDP

    grads = {s: gradients(s, bucket_cap_mb=0.05) for s in STRATEGIES[1:]}
    out = {
        "checks": {
            s: {
                "grad_diff": max(
                    (a - b).abs().max().item() for a, b in zip(g, grads["ddp"])
                ),
                "losses": train_steps(s, steps=steps)["losses"],
            }
            for s, g in grads.items()
        },
        "layouts": {
            "shakespeare, defaults": bucket_layouts("shakespeare"),
            "tiny, bucket_cap_mb=0.05": bucket_layouts("tiny", 0.05),
            "tiny, bucket_cap_mb=0.05, find_unused_parameters=True": bucket_layouts(
                "tiny", 0.05, find_unused_parameters=True
            ),
        },
    }
    static = _ddp(
        GPT(preset("tiny")), 0.05, find_unused_parameters=True, static_graph=True
    )
    out["static_graph buckets at construction"] = len(reducer_buckets(static))
    os.environ["DDP_SET_LAST_BUCKET_CAP"] = "1"  # read by the Reducer at its rebuild
    try:
        out["last bucket small"] = bucket_layouts("shakespeare")["layouts"][
            "from forward 2 on"
        ]
    finally:
        del os.environ["DDP_SET_LAST_BUCKET_CAP"]
    out["backward"] = gradient_when_backward_returns()
    out["autocast"] = autocast_bucket_dtypes()
    out["unused"] = {
        "BucketedDDP": unused_parameter(lambda m: BucketedDDP(m, bucket_cap_mb=1e-6)),
        "torch DDP": unused_parameter(_ddp),
        "torch DDP, find_unused_parameters=True": unused_parameter(
            lambda m: _ddp(m, find_unused_parameters=True)
        ),
    }
    out["bucket_view"] = {
        (batch, tokens): {
            (view, to_none): bucket_view_costs(view, to_none, batch, tokens)
            for view in (False, True)
            for to_none in (True, False)
        }
        for batch, tokens in ((4, 64), (1, 8))
    }
    ddp = _ddp(GPT(preset("tiny")))
    out["keys"] = (list(ddp.state_dict())[:2], list(ddp.module.state_dict())[:2])
    mine = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(mine, op=dist.ReduceOp.AVG)  # gloo accepts AVG for floats
    out["avg"] = mine.item()
    out["compile"] = {
        "defaults": compiled_ddp(n_embd=256),
        "bucket_cap_mb=0.05": compiled_ddp(n_embd=256, bucket_cap_mb=0.05),
    }
    return out
