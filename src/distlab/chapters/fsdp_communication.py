"""What FSDP2 sends, and the switches that change it: bytes per rank per step, counted.

Every function runs on each rank of a process group
(``distlab.infra.launch.run_ranks``), on the tiny GPT, and returns plain data for
``book/fsdp_communication.md``:

    # one step of each VARIANT (and DTYPE_VARIANT): the collectives of each phase
    run_ranks(volumes, nprocs=4)
    # 4 micro-batches under each FSDP2 switch (SWITCHES)
    run_ranks(switches, nprocs=4)
    # both, in one launch (the page)
    run_ranks(measure, nprocs=4)

The collectives are counted by ``distlab.tools.collective_bytes.CollectiveBytes`` (the
tensor bytes each c10d op was handed, and the ranks of its group), one counter per
phase (forward, backward, optimizer step), and what the rank really wrote to its
sockets is read from ``/proc/self/io`` around the same step. The figures are drawn from
those counts by ``distlab.figures.who_sends``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.costs.collectives import RING_FACTOR
from distlab.data import token_data
from distlab.infra.experiment import gpt
from distlab.runtime import rank_world
from distlab.tools.collective_bytes import CollectiveBytes, socket_bytes_written

# name -> FSDP2's reshard_after_forward (None: not FSDP2); every one is built by _wrap
# on 4 ranks. The names label the figures; a name's "(...)" is its second line.
VARIANTS = {
    "DDP": None,  # all-reduce of the gradients
    "ZeRO-1 (torch)": None,  # DDP + ZeroRedundancyOptimizer
    "ZeRO-2-like (FSDP2 False)": False,  # whole parameters kept to backward
    "ZeRO-3 (FSDP2 True)": True,  # resharded after forward, gathered again
    "FSDP2 2 (groups of 2)": 2,  # resharded to groups of 2 after forward
    "HSDP (2x2 mesh)": True,  # mesh (replicate 2, shard 2)
}
# FSDP2 True with a MixedPrecisionPolicy: (param_dtype, reduce_dtype)
DTYPE_VARIANTS = {
    "bf16 params, fp32 reduce": (torch.bfloat16, torch.float32),
    "bf16 params, bf16 reduce": (torch.bfloat16, torch.bfloat16),
}
PHASES = ("forward", "backward", "step")


# --- begin textbook ---
def textbook_psi(variant: str, n: int) -> float:
    """What the textbook says each rank sends per step, in Psi (the parameters'
    bytes), on a ring of n ranks: a gather or a scatter moves (n-1)/n of its tensor,
    an all-reduce twice that (it is a reduce-scatter, then an all-gather)."""
    ag, ar = RING_FACTOR["all-gather"], RING_FACTOR["all-reduce"]
    return {
        "DDP": ar(n),  # the paper's 2 Psi
        "ZeRO-1 (torch)": ar(n),  # the paper: as DDP
        "ZeRO-2-like (FSDP2 False)": 2 * ag(n),  # gather, then reduce-scatter
        "ZeRO-3 (FSDP2 True)": 3 * ag(n),  # the paper's 3 Psi: gather again
        "FSDP2 2 (groups of 2)": 2 * ag(n) + ag(2),  # backward gathers by 2
        # (2, 2): gathers and scatters in a shard group of 2, then an all-reduce of
        # the half-size shard across the 2 replicas
        "HSDP (2x2 mesh)": 3 * ag(2) + ar(2) / 2,
    }[variant]


# --- end textbook ---


def parameter_bytes(model: torch.nn.Module) -> int:
    """Psi: the bytes of the model's parameters, whole (a DTensor counts its
    global shape)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _mesh(variant: str):
    from torch.distributed.device_mesh import init_device_mesh

    if variant.startswith("HSDP"):
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))


# --- begin variants ---
def _wrap(variant: str, model: torch.nn.Module):
    """(the module to call, its optimizer) for one of VARIANTS or DTYPE_VARIANTS."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if variant == "DDP":
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
    # gradients all-reduced by DDP; each rank steps its slice, then broadcasts it
    if variant == "ZeRO-1 (torch)":
        return DDP(model), ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, lr=1e-3
        )
    reshard = VARIANTS.get(variant, True)  # DTYPE_VARIANTS: resharded
    param_dtype, reduce_dtype = DTYPE_VARIANTS.get(variant, (None, None))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=_mesh(variant), reshard_after_forward=reshard, mp_policy=policy)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    # the root too, explicitly: left unset it would stay gathered (False) whatever its
    # blocks do
    fully_shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


# --- end variants ---


def _batch(model, step: int, micro: int = 0):
    rank, world_size = rank_world()
    return token_data().batch(
        "train",
        4 * step + micro,
        2 * world_size,
        model.config.block_size,
        0,
        rank,
        world_size,
    )


def _one_step(wrapped, optimizer, x, y) -> dict[str, CollectiveBytes]:
    """One training step, its collectives counted phase by phase."""
    # --- begin count ---
    with CollectiveBytes() as forward:
        loss = wrapped(x, y)[1]
    with CollectiveBytes() as backward:
        loss.backward()  # DDP's Reducer, FSDP2's hooks: same thread on the CPU
    with CollectiveBytes() as step:
        optimizer.step()  # ZeRO-1's broadcasts
    # --- end count ---
    return {"forward": forward, "backward": backward, "step": step}


def volumes() -> dict[str, dict]:
    """For each of VARIANTS and DTYPE_VARIANTS, one training step after two warm-up
    steps (DDP rebuilds its buckets in the second, broadcasting their order once): the
    ``Call``s of each phase, the bytes this rank's process wrote meanwhile
    (``socket_bytes_written``), and Psi."""
    results = {}
    for variant in [*VARIANTS, *DTYPE_VARIANTS]:
        model = gpt("tiny")
        psi = parameter_bytes(model)
        wrapped, optimizer = _wrap(variant, model)
        for step in range(3):
            x, y = _batch(model, step)
            dist.barrier()  # the socket window holds this step's traffic only
            written = socket_bytes_written()
            phases = _one_step(wrapped, optimizer, x, y)
            dist.barrier()
            written = socket_bytes_written() - written
            optimizer.zero_grad(set_to_none=True)
        results[variant] = {
            "psi": psi,
            "phases": {name: c.calls for name, c in phases.items()},
            "socket_bytes": written,
            "unknown": [u for c in phases.values() for u in c.unknown],
        }
    return results


# --- begin switches ---
MICRO_BATCHES = 4

# name -> (mesh, the switches set on the root before each micro-batch but the last; the
# last restores them)
SWITCHES = {
    "sync every micro-batch": ("1-D", {}),
    "set_requires_gradient_sync(False)": ("1-D", {"set_requires_gradient_sync": False}),
    "... + set_reshard_after_backward(False)": (
        "1-D",
        {"set_requires_gradient_sync": False, "set_reshard_after_backward": False},
    ),
    "HSDP, sync every micro-batch": ("2-D", {}),
    "HSDP, set_requires_all_reduce(False)": ("2-D", {"set_requires_all_reduce": False}),
}


def _accumulate(model, switches: dict, into: list) -> None:
    """MICRO_BATCHES forward-backwards, the loss scaled by 1/MICRO_BATCHES, the switches
    on for all but the last; one CollectiveBytes per micro-batch appended to ``into``.
    """
    for micro in range(MICRO_BATCHES):
        last = micro == MICRO_BATCHES - 1
        for switch, value in switches.items():
            getattr(model, switch)(value if not last else not value)
        # waits for pending reductions, clears prefetch state
        model.set_is_last_backward(last)
        x, y = _batch(model, 1, micro)
        with CollectiveBytes() as counted:
            (model(x, y)[1] / MICRO_BATCHES).backward()
        into.append((counted, _gradient_bytes_held(model)))


# --- end switches ---


def _gradient_bytes_held(model) -> int:
    """Gradient bytes this rank holds: the sharded ``.grad``s plus the unsharded
    gradients FSDP2 keeps while it is not reducing
    (``FSDPParam.unsharded_accumulated_grad`` or the unsharded parameter's ``.grad``)
    and, in HSDP without all-reduce, the reduce-scattered sum it keeps
    (``FSDPParamGroup._partial_reduce_output``): private,
    torch/distributed/fsdp/_fully_shard/."""
    from torch.distributed.fsdp import FSDPModule

    held = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                # HSDP: reduce-scattered, not yet all-reduced
                partial = group._partial_reduce_output
                held += (
                    0 if partial is None else partial.numel() * partial.element_size()
                )
                for fsdp_param in group.fsdp_params:
                    shard = fsdp_param.sharded_param.grad
                    held += (
                        0
                        if shard is None
                        else shard.to_local().numel() * shard.element_size()
                    )
                    grad = fsdp_param.unsharded_accumulated_grad
                    if grad is None and hasattr(fsdp_param, "_unsharded_param"):
                        grad = fsdp_param._unsharded_param.grad
                    held += 0 if grad is None else grad.numel() * grad.element_size()
    return held


def _reference_gradients() -> list[torch.Tensor]:
    """The same accumulation in this process alone, on every rank's rows: what each
    switch must give."""
    world_size = rank_world()[1]
    model = gpt("tiny")
    for micro in range(MICRO_BATCHES):
        x, y = token_data().batch(
            "train", 4 + micro, 2 * world_size, model.config.block_size, 0, 0, 1
        )
        (model(x, y)[1] / MICRO_BATCHES).backward()
    return [p.grad for p in model.parameters()]


def switches() -> dict[str, dict]:
    """For each of SWITCHES: per micro-batch the collectives (count and tensor bytes by
    kind), the ring bytes sent and the gradient bytes held after it; the largest
    difference of the accumulated gradient from one process's
    (``_reference_gradients``); and Psi."""
    from torch.distributed.fsdp import fully_shard

    reference = _reference_gradients()
    results = {}
    for name, (mesh_kind, flags) in SWITCHES.items():
        model = gpt("tiny")
        mesh = _mesh("HSDP" if mesh_kind == "2-D" else "FSDP2")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        per_micro: list = []
        _accumulate(model, flags, per_micro)
        worst = max(
            (p.grad.full_tensor() - r).abs().max().item()
            for p, r in zip(model.parameters(), reference)
        )
        results[name] = {
            "psi": parameter_bytes(model),
            "counts": [c.counts() for c, _ in per_micro],
            "tensor_bytes": [c.tensor_bytes() for c, _ in per_micro],
            "ring_bytes": [sum(c.ring_bytes_sent().values()) for c, _ in per_micro],
            "grad_bytes_held": [held for _, held in per_micro],
            "max_grad_diff": worst,
        }
    return results


def measure() -> tuple[dict, dict]:
    """``volumes()`` and ``switches()`` in one launch: each launch costs seconds
    of imports."""
    return volumes(), switches()
