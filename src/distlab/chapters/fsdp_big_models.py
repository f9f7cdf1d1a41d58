"""A model bigger than one rank (book/fsdp_big_models.md): initialise it sharded, load
a full state dict into it, save one from it, clip its sharded gradients. All on every
rank of one ``observe`` launch (``tour``): one demo (a clip only rank 0 calls) fails on
purpose. Collectives counted by ``CommDebugMode``, bytes by ``MemTracker``
(``torch.distributed._tools.mem_tracker``, private, CPU-capable).
"""

from __future__ import annotations

import datetime
import math
import warnings
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker  # private, CPU-capable
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from distlab.data import token_data
from distlab.infra.experiment import gpt
from distlab.infra.observe import caught
from distlab.model import GPT, preset
from distlab.parallel import apply_fsdp
from distlab.runtime import rank_world

SEED = 7
CPU = torch.device("cpu")


def counts(comm: CommDebugMode) -> dict[str, int]:
    """``{"c10d.broadcast_.default": 31}`` -> ``{"broadcast": 31}``."""
    out = {}
    for op, n in comm.get_comm_counts().items():
        name = str(op).removesuffix(".default").split(".")[-1].rstrip("_")
        name = name.removesuffix("_into_tensor")
        out[name] = out.get(name, 0) + n
    return out


def sharded_on_meta(preset_name: str = "tiny") -> GPT:
    """The GPT built on the meta device (shapes only), sharded, then given memory for
    its shards alone: ``to_empty`` allocates each DTensor's local shard, uninitialised.
    """
    # outside: the data must not land on meta
    config = preset(preset_name, vocab_size=token_data().vocab_size)
    with torch.device("meta"):
        # GPT's own init runs on meta tensors: nothing is computed
        model = GPT(config, SEED)
    # skips the same-weights check on meta; says where the shards live
    apply_fsdp(model, device=CPU)
    model.to_empty(device=CPU)
    return model


def meta_bytes(preset_name: str = "tiny") -> int:
    """Bytes of real storage behind the parameters of a GPT built on ``meta``."""
    config = preset(preset_name, vocab_size=token_data().vocab_size)
    with torch.device("meta"):
        model = GPT(config, SEED)
    return sum(
        p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta
    )


# --- begin init-rows ---
def global_rows(param: torch.Tensor) -> tuple[int, int]:
    """(first global row, number of rows) of the part of ``param`` this rank holds."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return offset[0], shape[0]


def fill_rows_(local: torch.Tensor, first_row: int, key: int, std: float) -> None:
    """Row i of the whole parameter from a generator seeded by (key, i) alone: the
    values do not depend on how the rows are split over ranks, nor on what was
    drawn before."""
    for i in range(local.shape[0]):
        gen = torch.Generator().manual_seed((key * 1_000_003 + first_row + i) % 2**63)
        local[i] = torch.randn(local.shape[1:], generator=gen) * std


@torch.no_grad()
def init_sharded_(model: GPT, seed: int = SEED) -> None:
    """GPT-2's initialisation (as ``GPT.init_weights``) written for DTensor parameters:
    each rank fills only its own rows; no parameter is ever whole on any rank."""
    resid_std = 0.02 / model.config.n_layer**0.5 / 2**0.5
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if name.endswith("bias") or ".ln" in name or name.startswith("ln_f"):
            # deterministic: the same when sharded
            local.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        std = resid_std if name.endswith("proj.weight") else 0.02
        first, _ = global_rows(p)
        fill_rows_(local, first, key=seed * 65_537 + zlib.crc32(name.encode()), std=std)


# --- end init-rows ---


def init_check(preset_name: str = "tiny") -> dict:
    """``nn.init.normal_`` on DTensor shards vs on the whole tensor, same seed; then
    ``init_sharded_`` on shards vs on one process's whole model."""
    rank, world_size = rank_world()
    model = sharded_on_meta(preset_name)
    weight = model.wte.weight  # (65, 64), Shard(0): 33 rows on rank 0, 32 on rank 1
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # DTensor dispatch: normal_ runs on this rank's local rows
        nn.init.normal_(weight, std=0.02)
    whole = weight.full_tensor()
    torch.manual_seed(SEED)
    plain = nn.init.normal_(torch.empty(weight.shape), std=0.02)
    first, n = global_rows(weight)
    # rank 0's local normal_ drew the stream's first values; so did every other rank
    repeats = torch.equal(whole[first : first + n], plain[:n])
    model_sharded = sharded_on_meta(preset_name)
    init_sharded_(model_sharded)
    reference = gpt(preset_name)
    init_sharded_(reference)  # one process, whole tensors
    worst = max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model_sharded.parameters(), reference.parameters())
    )
    return {
        "warning": str(seen[0].message) if seen else None,
        "equal_to_one_process": torch.equal(whole, plain),
        "rows_equal_stream_start": int(repeats) * n,
        "local_rows": n,
        "rows_of_whole_equal": int((whole == plain).all(dim=1).sum()),
        "init_rows_max_diff": worst,
    }


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight counts once)."""
    return sum(
        {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors
        }.values()
    )


def broadcast_sizes() -> tuple[list, Callable]:
    """Patch ``dist.broadcast`` to log the bytes of each tensor it sends or receives;
    returns the log and the function that undoes the patch."""
    log, original = [], dist.broadcast

    def logged(tensor, *args, **kwargs):
        log.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.broadcast = logged
    return log, lambda: setattr(dist, "broadcast", original)


def load_full(preset_name: str = "tiny") -> tuple[GPT, dict]:
    """Rank 0 holds a one-process state dict (as a Hugging Face checkpoint gives); the
    other ranks pass ``{}``. ``set_model_state_dict`` broadcasts it, tensor by tensor,
    into the shards."""
    rank, _ = rank_world()
    model = sharded_on_meta(preset_name)
    # the only whole copy
    full_sd = gpt(preset_name, SEED).state_dict() if rank == 0 else {}
    before = {
        "tensors in the dict": len(full_sd),
        "dict bytes": storage_bytes(full_sd.values()),
        "shard bytes": storage_bytes(p.to_local() for p in model.parameters()),
    }
    tracker = MemTracker()
    # what existed before: the shards, rank 0's dict
    tracker.track_external(model, *full_sd.values())
    log, restore = broadcast_sizes()
    # --- begin load-full ---
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with CommDebugMode() as comm, tracker:
        # every rank calls it; only rank 0's dict is read
        set_model_state_dict(model, full_sd, options=options)
    # --- end load-full ---
    restore()
    return model, {
        **before,
        "collectives": counts(comm),
        "peak": tracker.get_tracker_snapshot("peak")[CPU]["Total"],
        "largest broadcast": max(log),
        "broadcast log": log,  # bytes of each broadcast, in order
        # (name, whole bytes, this rank's bytes) of each tensor, in the dict's order
        "tensors": [
            (k, nbytes(v), nbytes(v.to_local())) for k, v in model.state_dict().items()
        ],
        "dict now holds": sorted({type(v).__name__ for v in full_sd.values()}),
    }


def save_full(model: GPT, preset_name: str = "tiny") -> dict:
    """``get_model_state_dict`` with ``full_state_dict`` and ``cpu_offload``: rank 0
    gets the whole dict, the others an empty one; every rank takes part in the
    all-gathers."""
    tracker = MemTracker()
    tracker.track_external(model)
    # --- begin save-full ---
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with CommDebugMode() as comm, tracker:
        # every rank calls it; rank 0 gets the dict
        full = get_model_state_dict(model, options=options)
    # --- end save-full ---
    reference = gpt(preset_name, SEED).state_dict()
    return {
        "collectives": counts(comm),
        "keys": len(full),
        "max diff": max(
            ((full[k] - v).abs().max().item() for k, v in reference.items()),
            default=None,
        )
        if full
        else None,
        "types": sorted({type(v).__name__ for v in full.values()}),
        "dict bytes": storage_bytes(full.values()),
        "padded": sorted(
            k
            for k, v in full.items()
            if v.untyped_storage().nbytes() > v.numel() * v.element_size()
        ),
        "peak": tracker.get_tracker_snapshot("peak")[CPU]["Total"],
    }


def load_check(model: GPT, preset_name: str = "tiny") -> dict:
    """Every parameter (gathered) and one forward's loss, against the
    one-process model."""
    rank, world_size = rank_world()
    reference = gpt(preset_name, SEED)
    params = max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    x, y = token_data().batch(
        "train", 0, 4 * world_size, model.config.block_size, 0, 0, 1, CPU
    )
    rows = slice(rank * 4, (rank + 1) * 4)  # this rank's rows of the global batch
    logits = model(x[rows], y[rows])[0]
    return {
        "max param diff": params,
        "max logit diff": (logits - reference(x[rows])[0]).abs().max().item(),
    }


def backward_beside_one_process(model: GPT, preset_name: str) -> GPT:
    """One backward of the sharded ``model`` on this rank's 4 rows of a global batch,
    and of an unsharded copy on the whole batch (returned): the gradients to compare."""
    rank, world_size = rank_world()
    reference = gpt(preset_name, SEED)
    x, y = token_data().batch(
        "train", 0, 4 * world_size, model.config.block_size, 0, 0, 1, CPU
    )
    rows = slice(rank * 4, (rank + 1) * 4)  # this rank's rows of the global batch
    model(x[rows], y[rows])[1].backward()
    reference(x, y)[1].backward()
    return reference


def clip_check(model: GPT, max_norm: float = 0.5, preset_name: str = "tiny") -> dict:
    """One backward on this rank's rows, ``clip_grad_norm_`` over the DTensor gradients;
    against one process on the whole batch."""
    reference = backward_beside_one_process(model, preset_name)
    # --- begin clip ---
    with CommDebugMode() as comm:
        # every rank must call it
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # --- end clip ---
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    grads = max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    return {
        "collectives": counts(comm),
        "norm type": f"{type(norm).__name__} {getattr(norm, 'placements', '')}",
        "norm": norm.item(),
        "one-process norm": ref_norm.item(),
        "max clipped-grad diff": grads,
        "max grad": max(q.grad.abs().max().item() for q in reference.parameters()),
    }


def clip_on_rank0_only(report: str, pg_seconds: float = 2.0) -> dict:
    """The mistake: only rank 0 clips (say, to log the norm). Its all-reduce waits for a
    peer that never comes, until the process group's timeout. A toy model on a group
    with a short timeout."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank, _ = rank_world()
    short = dist.new_group(timeout=datetime.timedelta(seconds=pg_seconds))
    toy = fully_shard(nn.Linear(8, 8), mesh=DeviceMesh.from_group(short, "cpu"))
    toy(torch.ones(2, 8)).sum().backward()
    with caught(report) as failed:
        if rank == 0:
            torch.nn.utils.clip_grad_norm_(toy.parameters(), 1.0)
    dist.barrier()  # on the default group: rank 1 waits here until rank 0 has timed out
    return {"error": failed.error, "waited_s": failed.waited_s}


def hsdp_clip_check(preset_name: str = "tiny", max_norm: float = 0.5) -> dict:
    """On 4 ranks, a (replicate 2, shard 2) mesh: the norm from ``clip_grad_norm_``
    against one process's. Each gradient is ``Shard(0)`` on the shard dimension and
    ``Replicate`` on the other."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", (2, rank_world()[1] // 2), mesh_dim_names=("replicate", "shard")
    )
    model = apply_fsdp(gpt(preset_name, SEED), mesh=mesh)
    reference = backward_beside_one_process(model, preset_name)
    with CommDebugMode() as comm:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return {
        "grad placements": str(model.wte.weight.grad.placements),
        "collectives": counts(comm),
        "norm": norm.item(),
        "one-process norm": torch.nn.utils.clip_grad_norm_(
            reference.parameters(), max_norm
        ).item(),
    }


def load_safetensors(folder: str, preset_name: str = "tiny") -> dict:
    """Rank 0 writes one process's weights as ``model.safetensors`` (as a Hugging Face
    checkpoint is); then every rank reads only its own slices of it into its shards
    with DCP's ``HuggingFaceStorageReader``: no tensor is broadcast."""
    import os

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if rank_world()[0] == 0:
        full = gpt(preset_name, SEED).state_dict()
        # safetensors refuses two keys on one storage: the tied head gets a copy
        tensors = {k: v.clone() for k, v in full.items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"))
    dist.barrier()
    read = []

    class Logged(HuggingFaceStorageReader):
        # logs the elements of each slice read from the file (a private hook)
        def _process_read_request(self, f, req, planner):
            read.append(math.prod(req.lengths) * 4)  # fp32
            return super()._process_read_request(f, req, planner)

    model = sharded_on_meta(preset_name)
    # --- begin load-hf ---
    state = get_model_state_dict(model)  # sharded: DTensors, no gathering
    with CommDebugMode() as comm:
        dcp.load(state, storage_reader=Logged(folder))  # each rank its slices
    set_model_state_dict(model, state)
    # --- end load-hf ---
    return {
        "read bytes": sum(read),
        "shard bytes": storage_bytes(p.to_local() for p in model.parameters()),
        "collectives": counts(comm),
        "max param diff": load_check(model, preset_name)["max param diff"],
    }


def tour(report: str, preset_name: str = "tiny") -> dict:
    """Everything the page shows, on every rank of one launch."""
    model, load = load_full(preset_name)
    return {
        "init": init_check(preset_name),
        "meta bytes": meta_bytes(preset_name),
        "load": load,
        "hf": load_safetensors(report, preset_name),
        "loaded": load_check(model, preset_name),
        "save": save_full(model, preset_name),
        "clip": clip_check(model, preset_name=preset_name),
        "rank0_only": clip_on_rank0_only(report),
    }
