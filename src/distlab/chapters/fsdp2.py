"""Look inside FSDP2 on our GPT: shards, collectives, dtypes, memory and speed, per rank.

Every function here runs on each rank of a process group (through ``distlab.infra.launch.run_ranks``)
and returns plain Python data for the FSDP2 chapter and ``distlab.bench.fsdp``:

    run_ranks(shard_table, nprocs=2)                  # each parameter's global and local shape
    run_ranks(step_trace, nprocs=2, args=("tiny",))   # FSDP2's own profiler ranges, one step
    run_ranks(train, nprocs=2, args=("fsdp2",))       # losses, bytes per rank, tokens/s

Strategies (``STRATEGIES``, names from ``distlab.infra.experiment``): ``single``, ``ddp``,
``fsdp2``, ``fsdp2-no-reshard``, ``fsdp2-bf16`` and ``hsdp``.
"""

from __future__ import annotations

import contextlib

import torch

from distlab.infra import experiment
from distlab.infra.experiment import build, gpt
from distlab.model import GPT, preset
from distlab.parallel import apply_fsdp
from distlab.runtime import dist_env, pick_device

STRATEGIES = ("single", "ddp", "fsdp2", "fsdp2-no-reshard", "fsdp2-bf16", "hsdp")


def shard_table(preset_name: str = "tiny", strategy: str = "fsdp2") -> list[dict]:
    """For each parameter: its name, global shape, this rank's local shape and placements."""
    model = build(strategy, preset_name).model
    return [
        {"name": name, "global": tuple(p.shape), "local": tuple(p.to_local().shape), "placements": str(p.placements)}
        for name, p in model.named_parameters()
    ]


def train(
    strategy: str,
    preset_name: str = "tiny",
    steps: int = 5,
    global_batch: int = 16,
    seed: int = 1337,
    lr: float = 1e-3,
    track_peak: bool = False,
) -> dict:
    """``experiment.train``: global mean losses, step times, ``state_bytes`` per rank (counted
    from the tensors after the first step); and ``peak``: with ``track_peak``, the peak
    bytes PyTorch's memory tracker saw during the last step, by kind (else None)."""
    peak: dict[str, int] = {}

    def track_the_last_step(exp, step):
        if track_peak and step == steps - 1:
            return _peak_bytes(exp.model, exp.optimizer, strategy, peak)
        return contextlib.nullcontext()

    result = experiment.train(strategy, preset_name, steps, global_batch, seed, lr, around_step=track_the_last_step)
    return {**result, "peak": peak or None}


@contextlib.contextmanager
def _peak_bytes(model, optimizer, strategy: str, into: dict):
    """Peak bytes by kind during the block, from PyTorch's (private, CPU-capable) memory trackers."""
    if strategy.startswith("fsdp2") or strategy == "hsdp":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker as Tracker
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        def Tracker(model, optimizer):  # noqa: N802 - same call shape as FSDPMemTracker
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            return tracker

    tracker = Tracker(model, optimizer)
    with tracker:
        yield
    device = next(iter(tracker.get_tracker_snapshot("peak")))
    into.update({str(kind): int(n) for kind, n in tracker.get_tracker_snapshot("peak")[device].items()})


def step_trace(preset_name: str = "tiny", reshard_after_forward: bool = True, global_batch: int = 8) -> dict:
    """One training step under the profiler: FSDP2's named ranges (ms from the step's start)
    and how many all-gathers and reduce-scatters gloo ran."""
    from torch.profiler import ProfilerActivity, profile

    exp = build("fsdp2" if reshard_after_forward else "fsdp2-no-reshard", preset_name, global_batch)
    exp.backward(exp.loss(0))  # warm-up: the first step also builds FSDP2's lazy state
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        exp.backward(exp.loss(0))
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start
    spans = [
        (e.name, (e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3)
        for e in events
        if e.name.startswith("FSDP::")
    ]
    count = lambda prefix: sum(e.name.startswith(prefix) for e in events)  # noqa: E731
    return {
        "spans": spans,
        "all_gathers": count("c10d::_allgather_base_"),
        "reduce_scatters": count("c10d::_reduce_scatter_base_"),
    }


def unsharded_between_forward_and_backward(preset_name: str = "tiny", reshard_after_forward: bool = True) -> int:
    """Bytes of unsharded (all-gathered) block parameters still alive after the forward pass."""
    exp = build("fsdp2" if reshard_after_forward else "fsdp2-no-reshard", preset_name)
    model = exp.model
    x = torch.zeros(2, preset(preset_name).block_size, dtype=torch.long, device=exp.device)
    _, loss = model(x, x)
    alive = 0
    for block in model.blocks:
        for p in block.parameters(recurse=True):
            # a resharded block shows its DTensor shards again; an unsharded one plain tensors
            alive += 0 if hasattr(p, "to_local") else p.numel() * p.element_size()
    loss.backward()
    return alive


def mixed_precision_dtypes() -> dict[str, str]:
    """Dtypes under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``."""
    exp = build("fsdp2-bf16", "tiny")
    model, device = exp.model, exp.device
    seen = {}
    block = model.blocks[0]
    block.register_forward_pre_hook(
        lambda m, args: seen.update(
            {
                "parameter inside forward": str(m.attn.qkv.weight.dtype),
                "activation entering a block": str(args[0].dtype),
            }
        )
    )
    x = torch.zeros(2, 8, dtype=torch.long, device=device)
    logits, loss = model(x, x)
    loss.backward()
    p = block.attn.qkv.weight
    seen.update(
        {
            "sharded parameter (kept)": str(p.dtype),
            "logits": str(logits.dtype),
            "gradient of the shard": str(p.grad.dtype),
        }
    )
    return seen


def meta_init_equals_plain(preset_name: str = "tiny", seed: int = 7) -> float:
    """Build on the meta device (no memory), shard, allocate only the shards, then initialise:
    the largest difference from a plainly built model's weights."""
    from torch.distributed.tensor.experimental import implicit_replication

    device = pick_device("auto", dist_env()[1])
    plain = gpt(preset_name, seed).to(device)  # the reference, built and initialised plainly
    with torch.device("meta"):
        model = GPT(plain.config, seed)  # the same config, shapes only: nothing is allocated
    apply_fsdp(model)
    model.to_empty(device=device)  # allocates this rank's shards, uninitialised
    with implicit_replication():  # a full-size tensor copied into a DTensor keeps this rank's slice
        model.init_weights(seed)
    return max((a.full_tensor() - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))


def gradient_check(preset_name: str = "tiny", global_batch: int = 16) -> float:
    """Largest |FSDP2 shard gradient - the same slice of the single-process gradient|.

    The pitfall this guards: gradients must be *averaged* over ranks. A sum would be N times
    too large and this difference as large as the gradients themselves."""
    plain = build("single", preset_name, global_batch)
    plain.backward(plain.loss(0))  # the whole batch in this process
    sharded = build("fsdp2", preset_name, global_batch)
    sharded.backward(sharded.loss(0))  # this rank's rows
    worst = 0.0
    for p, ref in zip(sharded.model.parameters(), plain.model.parameters()):
        full = p.grad.full_tensor()  # reassemble the shards to compare with the whole gradient
        worst = max(worst, (full - ref.grad).abs().max().item())
    return worst
