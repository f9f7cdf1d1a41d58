"""Parallelism applied to a model from outside, so ``model.py`` never changes.

Order matters when several are combined (torchtitan's rule, which the labs follow):
activation checkpointing first (``apply_activation_checkpointing``), then
``torch.compile`` (``apply_compile``), then the data-parallel wrapper (FSDP2's
``fully_shard``); DDP wraps the finished module last of all.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# --- begin activation checkpointing ---
AC_MODES = ("none", "full", "selective")


def _ops(*names: str) -> tuple:
    # attention kernels differ by device and build; keep those this torch has
    aten = torch.ops.aten
    return tuple(getattr(aten, name).default for name in names if hasattr(aten, name))


# Outputs worth keeping: matrix products and attention (most of the FLOPs to recompute).
# Named as OpOverloads (``aten.addmm.default``): the policy sees those, never
# ``aten.addmm``. A Linear with a bias on a (B, T, C) input runs ``addmm``; without a
# bias, ``mm``.
SAVE_MATMULS_AND_ATTENTION = _ops(
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def save_ops_policy(save_ops=SAVE_MATMULS_AND_ATTENTION) -> Callable:
    """A selective-checkpointing policy: keep the outputs of ``save_ops`` from the
    forward pass, recompute everything else (LayerNorm, GELU, additions: cheap
    pointwise work)."""
    from torch.utils.checkpoint import CheckpointPolicy

    not_overloads = [op for op in save_ops if not isinstance(op, torch._ops.OpOverload)]
    # an OpOverloadPacket never equals the op the policy is shown: it would
    # match nothing
    if not_overloads:
        raise TypeError(
            "name ops with their overload, e.g. torch.ops.aten.mm.default, not "
            f"{not_overloads}"
        )
    save = frozenset(save_ops)

    def policy(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op in save
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return policy


def apply_activation_checkpointing(
    model: nn.Module, mode: str = "full", every: int = 1, policy: Callable | None = None
) -> nn.Module:
    """Checkpoint every ``every``-th transformer block of ``model``, in place.

    ``full``: a checkpointed block keeps only its input from the forward pass and runs
    its forward again inside the backward pass. ``selective``: it also keeps what
    ``policy`` says to save (default: ``save_ops_policy()``) and recomputes only the
    rest. ``none`` leaves the model alone. Gradients are unchanged in every mode.

    Apply it before ``fully_shard``/DDP, so each FSDP unit is a checkpointed block.
    ``checkpoint_wrapper`` is non-reentrant and restores the RNG state for the
    recompute; its parameter names gain a ``_checkpoint_wrapped_module.`` part, which
    its state-dict hooks (and DCP's) strip, so checkpoints and ``model.pt`` keep the
    plain model's keys.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode not in AC_MODES:
        raise ValueError(
            f"unknown activation checkpointing mode {mode!r}; choose one of "
            f"{', '.join(AC_MODES)}"
        )
    if every < 1:
        raise ValueError(
            f"every must be 1 or more (checkpoint every k-th block), got {every}"
        )
    if mode == "none":
        return model
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, policy or save_ops_policy()
        )
    for i, block in enumerate(model.blocks):
        if i % every == 0:
            model.blocks[i] = checkpoint_wrapper(block, **kwargs)
    return model


# --- end activation checkpointing ---


# --- begin compile ---
def apply_compile(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile each transformer block of ``model`` with ``torch.compile``, in place.

    Per block, as torchtitan does: the blocks are the repeated work, and they are alike,
    so one compiled graph serves all of them (measured with torch 2.13: one graph for a
    12-block GPT); the embeddings, the head and the loss stay eager.
    ``nn.Module.compile`` compiles a module's call and leaves the module itself in place
    (``torch/nn/modules/module.py``), so parameter names and ``state_dict`` keys stay
    the plain model's; putting ``torch.compile(block)``, an ``OptimizedModule``, in its
    place would add ``_orig_mod.`` to the keys of ``model.state_dict()`` (what a
    ``torch.save`` user sees), though not to DCP's: ``get_state_dict`` strips the
    prefix, so the labs' checkpoints would load either way. After activation
    checkpointing, a block is its checkpoint wrapper and is compiled with the recompute
    inside; before sharding, FSDP2's hooks then run around the compiled block, outside
    the graph:
    ``nn.Module.compile`` wraps ``_call_impl``, hooks included, but Dynamo skips that
    frame (``torch.nn`` is in its skip list, ``torch/_dynamo/trace_rules.py``) and
    compiles the block's ``forward`` frame, so the hooks run eagerly, with no graph
    break (``book/fsdp_compile.md`` counts the graphs); where Dynamo does trace into an
    FSDP2 hook, it is ``_dynamo_disable``d (``_fsdp_common.py`` in
    ``torch/distributed/fsdp/_fully_shard/``). Compiling happens at the first call, not
    here: the first steps take longer (the labs time them apart).
    """
    for block in model.blocks:
        block.compile(**compile_kwargs)
    return model


# --- end compile ---


def apply_ddp(model: nn.Module, device: torch.device, **ddp_kwargs) -> DDP:
    """Wrap ``model`` (already on ``device``) in DistributedDataParallel.

    Move first, wrap second: DDP registers its gradient hooks and buffers for the
    parameters it is given, and broadcasts rank 0's values to every rank right here.
    On a GPU, ``device_ids`` names this rank's one device; on a CPU it must stay unset.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, **ddp_kwargs)


# The torch.distributed call FSDP2 reduce-scatters the gradients with, for a test or an
# exercise that counts them: reduce_scatter_single from torch 2.13, where
# reduce_scatter_tensor became its deprecated alias (distributed_c10d.py); only
# reduce_scatter_tensor before (a GPU machine's preinstalled torch may be older).
FSDP_REDUCE_SCATTER = (
    "reduce_scatter_single"
    if hasattr(torch.distributed, "reduce_scatter_single")
    else "reduce_scatter_tensor"
)


def apply_fsdp(
    model: nn.Module,
    mesh=None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    check_weights: bool = True,
    device: torch.device | None = None,
    offload_policy=None,
) -> nn.Module:
    """Shard ``model`` with FSDP2: each transformer block is one unit, then the root.

    A block's parameters are all-gathered just before its forward and (with
    ``reshard_after_forward``, ZeRO-3) freed right after it, then gathered again for its
    backward, where its gradients are reduce-scattered. The root unit holds what is left
    (embeddings, final LayerNorm; the head is tied to the token embedding) and stays
    gathered from its forward to its backward. ``fully_shard`` changes the model in
    place: its parameters become DTensors holding this rank's shard.

    ``param_dtype``: the FSDP2 labs' one mixed-precision mechanism (no autocast):
    parameters are all-gathered in this dtype (bf16), so forward and backward compute in
    it, while the sharded parameters (the master weights), the gradient reduce-scatter
    and the optimizer stay fp32. ``mesh``: a 1-D mesh shards over all ranks (the
    default); a 2-D mesh ("replicate", "shard") is hybrid sharding. ``check_weights``:
    first check that every rank holds the same weights (``fully_shard`` neither
    broadcasts nor checks them; see ``check_same_weights``).

    Without a ``mesh``, the 1-D mesh is built on the device in use: ``device`` if given,
    else the device of the model's parameters. Move first, shard second, as with DDP:
    the parameters then already say where training runs, and no second argument can
    disagree with them. FSDP2's own default would instead follow
    ``torch._C._get_accelerator()``, a CUDA mesh whenever a GPU is visible, whatever
    ``--device`` chose (``_init_default_mesh`` in
    ``torch/distributed/fsdp/_fully_shard/_fsdp_init.py``). A model on the ``meta``
    device has no device yet: pass ``device``, where its shards will live.
    ``offload_policy``: FSDP2's ``CPUOffloadPolicy`` for every unit (shards, gradients
    and the optimizer step in CPU memory; ``book/fsdp_prefetch_offload.md``); build the
    model on the CPU and pass ``device`` then, since the parameters no longer say where
    training runs.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if check_weights:
        check_same_weights(model)
    if mesh is None:
        mesh = _mesh_on(device or _parameters_device(model))
    mp = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype
        else None
    )
    kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root never reshards after forward: backward starts with the head (tied to the
    # token embedding), so freeing it would only gather it again at once. Left unset,
    # FSDP2 makes the same choice for the root (_lazy_init in
    # torch/distributed/fsdp/_fully_shard/ _fsdp_state.py); an explicit True on the root
    # is honoured, and costs an all-gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def _parameters_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        found = ", ".join(sorted(map(str, devices))) or "no parameters"
        raise ValueError(
            "apply_fsdp builds its mesh on the parameters' device, and found "
            f"{found}: pass device="
        )
    return devices.pop()


def _mesh_on(device: torch.device):
    """A 1-D mesh over every rank of the default group, on ``device``'s type (cpu:
    gloo's CPU tensors; cuda: NCCL's GPU tensors, each rank on its current device)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def first_differing_parameter(
    model: nn.Module, group=None
) -> tuple[int, str, float, float] | None:
    """(rank, parameter name, its sum there, rank 0's sum) of the first parameter that
    differs from rank 0's, or None. A collective: every rank of ``group`` calls it.

    Compares two fp64 checksums per parameter (sum and sum of squares) in one small
    all-gather, on the parameters' own device (NCCL gathers only GPU tensors). Equal
    sums do not prove equal weights, but a different seed, or replicas that drift apart,
    change them.
    """
    import torch.distributed as dist

    named = list(model.named_parameters())
    mine = torch.stack(
        [
            torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
            for _, p in named
        ]
    )
    # (n_params, 2) each
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    everyone = [t.cpu() for t in everyone]
    for rank, theirs in enumerate(everyone):
        differs = (theirs != everyone[0]).any(dim=1).nonzero()
        if len(differs):
            i = differs[0].item()
            return rank, named[i][0], theirs[i, 0].item(), everyone[0][i, 0].item()
    return None


def check_same_weights(model: nn.Module, group=None) -> None:
    """Raise ``UserError`` unless every rank of ``group`` holds the same (unsharded)
    weights.

    DDP broadcasts rank 0's weights when it wraps a model; ``fully_shard`` does not, and
    does not compare them either: each rank keeps its own slice of whatever it built,
    and ranks that built different weights train, without an error, a model none of them
    built. Call it before sharding (a collective: every rank calls it); it compares
    checksums (``first_differing_parameter``). Nothing to compare with one rank, or on
    the meta device (no values yet).
    """
    import torch.distributed as dist

    from distlab.errors import UserError

    named = list(model.named_parameters())
    if (
        not (dist.is_available() and dist.is_initialized())
        or dist.get_world_size(group) == 1
    ):
        return
    if any(p.is_meta for _, p in named):
        return
    differing = first_differing_parameter(model, group)
    if differing:
        rank, name, _, _ = differing
        raise UserError(
            f"rank {rank}'s {name!r} differs from rank 0's before sharding: "
            "build the model from the same "
            "seed (or load the same weights) on every rank; fully_shard neither "
            "broadcasts nor checks them"
        )


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """FSDP2's counterpart of DDP's ``no_sync()``: backward inside the block keeps the
    gradients unsharded and local, with no reduce-scatter; the next backward outside it
    reduce-scatters the accumulated sum. The unsharded gradients cost a full copy of the
    gradients per rank while they accumulate (FSDP2's ``set_requires_gradient_sync``).
    """
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict on the CPU of rank 0 (empty on the other ranks).

    A collective: every rank must call it (one all-gather per tensor); with
    ``cpu_offload`` only rank 0 keeps the results (``ranks_only=(0,)`` in
    ``_maybe_full_or_cpu_state_dict``, torch/distributed/checkpoint/state_dict.py). The
    keys are the plain model's, so lab 1 loads it.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
