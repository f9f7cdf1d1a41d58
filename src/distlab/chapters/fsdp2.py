"""Look inside FSDP2 on our GPT: shards, collectives, dtypes, memory and speed, per rank.

Every function here runs on each rank of a process group (through ``distlab.infra.launch.run_ranks``)
and returns plain Python data for the FSDP2 chapter and ``distlab.bench.fsdp``:

    run_ranks(shard_table, nprocs=2)                  # each parameter's global and local shape
    run_ranks(step_trace, nprocs=2, args=("tiny",))   # FSDP2's own profiler ranges, one step
    run_ranks(train, nprocs=2, args=("fsdp2",))       # losses, bytes per rank, tokens/s
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from distlab.data import TokenData, load_corpus
from distlab.memory import state_bytes
from distlab.model import GPT, preset
from distlab.parallel import apply_ddp, apply_fsdp
from distlab.runtime import DTYPES, dist_env, pick_device, synchronize

STRATEGIES = ("single", "ddp", "fsdp2", "fsdp2-no-reshard", "fsdp2-bf16", "hsdp")


@functools.cache
def _data() -> TokenData:
    return TokenData(load_corpus())  # once per process: every function here builds models from it


def _model(preset_name: str, seed: int = 1337) -> GPT:
    return GPT(preset(preset_name, vocab_size=_data().tokenizer.vocab_size), seed=seed)


def _device() -> torch.device:
    return pick_device("auto", dist_env()[1])


def wrap(strategy: str, model: GPT, device: torch.device):
    """``model`` (on ``device``) under one of ``STRATEGIES``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == "single":
        return model
    if strategy == "ddp":
        return apply_ddp(model, device)
    if strategy == "hsdp":  # shard inside groups of 2 ranks, replicate across the groups
        from torch.distributed.device_mesh import init_device_mesh

        n = dist.get_world_size()
        mesh = init_device_mesh(device.type, (n // 2, 2), mesh_dim_names=("replicate", "shard"))
        return apply_fsdp(model, mesh=mesh)
    return apply_fsdp(
        model,
        reshard_after_forward=strategy != "fsdp2-no-reshard",
        param_dtype=DTYPES["bf16"] if strategy == "fsdp2-bf16" else None,
    )


def shard_table(preset_name: str = "tiny", strategy: str = "fsdp2") -> list[dict]:
    """For each parameter: its name, global shape, this rank's local shape and placements."""
    device = _device()
    model = wrap(strategy, _model(preset_name).to(device), device)
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
    """``steps`` AdamW steps under ``strategy``: global mean losses, step times, bytes per rank.

    ``state``: bytes of parameters, gradients and AdamW state this rank holds, counted from
    the tensors after the first step (AdamW allocates its state lazily). ``peak``: with
    ``track_peak``, the peak bytes PyTorch's memory tracker saw during the last step, by kind.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = _device()
    data = _data()
    model = wrap(strategy, _model(preset_name, seed).to(device), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    T = preset(preset_name).block_size
    losses, seconds, state, peak = [], [], None, None

    def step(i: int) -> None:
        x, y = data.batch("train", i, global_batch, T, seed, rank, world, device)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        nonlocal state
        if state is None:
            state = state_bytes(model, optimizer)  # after the first step: gradients and AdamW exist
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)  # SUM: gloo has no AVG for every op
        losses.append(total.item() / world)

    for i in range(steps):
        synchronize(device)
        start = time.perf_counter()
        if track_peak and i == steps - 1:
            peak = _tracked(lambda i=i: step(i), model, optimizer, strategy)
        else:
            step(i)
        seconds.append(time.perf_counter() - start)
    timed = seconds[2:] or seconds
    return {
        "strategy": strategy,
        "world_size": world,
        "losses": losses,
        "step_s": seconds,
        "tokens_per_s": global_batch * T * len(timed) / sum(timed),
        "state": state,
        "peak": peak,
    }


def _tracked(run_step, model, optimizer, strategy: str) -> dict:
    """Peak bytes by kind during one step, from PyTorch's (private, CPU-capable) memory trackers."""
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
        run_step()
    device = next(iter(tracker.get_tracker_snapshot("peak")))
    return {str(kind): int(n) for kind, n in tracker.get_tracker_snapshot("peak")[device].items()}


def step_trace(preset_name: str = "tiny", reshard_after_forward: bool = True, global_batch: int = 8) -> dict:
    """One training step under the profiler: FSDP2's named ranges (ms from the step's start)
    and how many all-gathers and reduce-scatters gloo ran."""
    from torch.profiler import ProfilerActivity, profile

    device = _device()
    model = apply_fsdp(_model(preset_name).to(device), reshard_after_forward=reshard_after_forward)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data().batch("train", 0, global_batch, preset(preset_name).block_size, 0, rank, world, device)
    model(x, y)[1].backward()  # warm-up: the first step also builds FSDP2's lazy state
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x, y)[1].backward()
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
    device = _device()
    model = apply_fsdp(_model(preset_name).to(device), reshard_after_forward=reshard_after_forward)
    x = torch.zeros(2, preset(preset_name).block_size, dtype=torch.long, device=device)
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
    device = _device()
    model = apply_fsdp(_model("tiny").to(device), param_dtype=torch.bfloat16)
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

    device = _device()
    with torch.device("meta"):
        model = _model(preset_name, seed)  # shapes only: nothing is allocated
    apply_fsdp(model)
    model.to_empty(device=device)  # allocates this rank's shards, uninitialised
    with implicit_replication():  # a full-size tensor copied into a DTensor keeps this rank's slice
        model.init_weights(seed)
    plain = _model(preset_name, seed).to(device)
    return max((a.full_tensor() - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))


def gradient_check(preset_name: str = "tiny", global_batch: int = 16) -> float:
    """Largest |FSDP2 shard gradient - the same slice of the single-process gradient|.

    The pitfall this guards: gradients must be *averaged* over ranks. A sum would be N times
    too large and this difference as large as the gradients themselves."""
    device = _device()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = _data()
    T = preset(preset_name).block_size
    plain = _model(preset_name).to(device)
    x, y = data.batch("train", 0, global_batch, T, 0, 0, 1, device)
    plain(x, y)[1].backward()
    model = apply_fsdp(_model(preset_name).to(device))
    x, y = data.batch("train", 0, global_batch, T, 0, rank, world, device)
    model(x, y)[1].backward()
    worst = 0.0
    for p, ref in zip(model.parameters(), plain.parameters()):
        full = p.grad.full_tensor()  # reassemble the shards to compare with the whole gradient
        worst = max(worst, (full - ref.grad).abs().max().item())
    return worst
