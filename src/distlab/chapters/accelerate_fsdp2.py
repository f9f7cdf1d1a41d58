"""Accelerate's FSDP2 configuration, from the YAML a reader writes to the model
``prepare`` builds.

Run on CPU ranks by ``launch.run_ranks(tour, ...)``: each config file is turned into the
ranks' environment by Accelerate's own launcher code (``launcher_env``), the plugin is
built from that environment as ``Accelerator`` builds it, and the model ``prepare``
returns is inspected. On CPU ranks Accelerate never selects its FSDP path by itself (the
Accelerate chapter shows the DDP it gives instead), so ``in_fsdp2_mode`` from that
chapter puts the CPU ``Accelerator`` in the mode a GPU run is in; everything after that
is Accelerate's code, unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import torch

from distlab.model import GPT, preset
from distlab.runtime import rank_world
from distlab.tools.collective_bytes import CollectiveBytes

SEED = 0
CPU = torch.device("cpu")

# --- begin fsdp1-config ---
FSDP1_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: 'no'
num_machines: 1
num_processes: 2
fsdp_config:
  fsdp_version: 1
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
  fsdp_activation_checkpointing: true
  fsdp_offload_params: false
"""
# --- end fsdp1-config ---

# --- begin minimal-config ---
MINIMAL_CONFIG = """\
distributed_type: FSDP
num_processes: 2
fsdp_config:
  fsdp_version: 2
"""
# --- end minimal-config ---

BLOCKS_CONFIG = (
    MINIMAL_CONFIG
    + """\
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_cpu_ram_efficient_loading: false
"""
)


def launcher_env(config_file: str | os.PathLike) -> dict[str, str]:
    """The Accelerate variables ``accelerate launch --config_file FILE`` gives
    every rank.

    The same calls ``launch_command`` makes: parse, fill the arguments from the file
    (``_validate_launch_command``), then ``prepare_multi_gpu_env``, which
    ``multi_gpu_launcher`` runs before it starts the processes
    (accelerate/commands/launch.py, accelerate/utils/launch.py).
    """
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(config_file), "train.py"]
    )
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {
        k: v
        for k, v in sorted(env.items())
        if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"
    }


def plugin_from_env(env: dict[str, str]):
    """``FullyShardedDataParallelPlugin()`` with no arguments, as ``Accelerator`` builds
    it under the launcher (accelerator.py): every field is read from the
    ``FSDP_*`` variables."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    with mock.patch.dict(os.environ, env):
        return FullyShardedDataParallelPlugin()


def materialised_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameter storages that hold memory (meta tensors
    hold none)."""
    storages = {}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type != "meta":
            storages[local.untyped_storage().data_ptr()] = (
                local.untyped_storage().nbytes()
            )
    return sum(storages.values())


def _units(model: torch.nn.Module) -> dict:
    from torch.distributed.fsdp import FSDPModule

    return {
        name or "root": m
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
    }


def _group(unit):
    # None for a unit that holds no parameter
    return unit._get_fsdp_state()._fsdp_param_group


def prepared_model(env: dict[str, str], model: torch.nn.Module):
    """``prepare`` the model and an AdamW in Accelerate's FSDP2 mode, with the plugin
    the launcher's variables ``env`` give; returns the accelerator, model and optimizer.
    """
    from distlab.chapters.accelerate import in_fsdp2_mode

    with mock.patch.dict(os.environ, env):
        accelerator = in_fsdp2_mode(plugin_from_env(env), "no")
        model, optimizer = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
    return accelerator, model, optimizer


def inspect_config(env: dict[str, str], save_dir: str) -> dict:
    """What Accelerate built from ``env``: the plugin's fields, then, on the prepared
    tiny GPT, the units, which of them are sharded again after the forward, the
    collectives of one step, the checkpoint wrappers, and the files
    ``save_state`` writes."""
    from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
    )

    accelerator, model, optimizer = prepared_model(env, GPT(preset("tiny"), seed=SEED))
    plugin = accelerator.state.fsdp_plugin
    units = _units(model)
    x = torch.randint(
        0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    with CollectiveBytes() as forward:
        _, loss = model(x, x)
    # measured, not read from the settings: is each unit's parameter sharded again after
    # the forward?
    resharded = {
        n: _group(u).is_sharded for n, u in units.items() if _group(u) is not None
    }
    with CollectiveBytes() as backward:
        accelerator.backward(loss)
    lm_head_before = model.lm_head.weight.to_local().clone()
    optimizer.step()
    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    some_unit = next(u for u in units.values() if _group(u) is not None)
    mesh = _group(some_unit).mesh_info.mesh
    # the dict save_fsdp_model writes, built as it builds it: per rank (sharded) or rank
    # 0's whole (full)
    saved = _get_model_state_dict(model, sd_options=_prepare_sd_options(plugin))
    saved = [t.to_local() if hasattr(t, "to_local") else t for t in saved.values()]
    accelerator.save_state(save_dir)
    accelerator.wait_for_everyone()
    # what a script calls to export the model: a collective, full tensors on rank 0
    exported = accelerator.get_state_dict(model)
    files = {
        str(p.relative_to(save_dir)): p.stat().st_size
        for p in sorted(Path(save_dir).rglob("*"))
        if p.is_file()
    }
    return {
        "plugin": {
            "reshard_after_forward": plugin.reshard_after_forward,
            "state_dict_type": plugin.state_dict_type.name,
            "activation_checkpointing": plugin.activation_checkpointing,
            "cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading,
            "auto_wrap_policy": getattr(
                plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy
            ).__name__
            if plugin.auto_wrap_policy
            else None,
        },
        "units": list(units),
        "param dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "mixed precision policy": plugin.mixed_precision_policy is not None,
        "resharded after forward": resharded,
        "mesh": f"{mesh.device_type} {tuple(mesh.shape)}",
        "forward all-gathers": forward.counts().get("all-gather", 0),
        "backward all-gathers": backward.counts().get("all-gather", 0),
        "checkpoint wrappers": len(wrappers),
        "preserve_rng_state": sorted(
            {w.checkpoint_fn.keywords.get("preserve_rng_state") for w in wrappers}
        ),
        "lm_head tied to wte": model.lm_head.weight is model.wte.weight,
        "lm_head stepped": not torch.equal(
            lm_head_before, model.lm_head.weight.to_local()
        ),
        "saved tensors": len(saved),
        "saved tensor bytes": sum(t.numel() * t.element_size() for t in saved),
        "files": files,
        "get_state_dict tensors": len(exported),
    }


def save_checkpoint(path: str | os.PathLike) -> None:
    """A one-process checkpoint of the tiny GPT, as a pretrained model's weights file
    would be."""
    torch.save(GPT(preset("tiny"), seed=SEED + 1).state_dict(), path)


def with_tie_weights(model: GPT) -> GPT:
    """Give the GPT the ``tie_weights`` method Transformers models have: Accelerate
    calls it, when it exists, after moving the model to meta and after loading
    (``fsdp2_prepare_model``), which is what keeps ``lm_head`` and ``wte`` one
    parameter. model.py is not touched."""
    model.tie_weights = lambda: setattr(model.lm_head, "weight", model.wte.weight)
    return model


# --- begin before-prepare ---
def model_before_prepare(checkpoint: str, others: str, tie: bool) -> GPT:
    """The model each rank hands to ``prepare``. Rank 0 reads the checkpoint; the other
    ranks read it too (``others="read"``), or hold uninitialised CPU tensors
    (``"empty"``, what the comment in ``fsdp2_prepare_model`` says Transformers gives
    them), or shapes on the meta device (``"meta"``)."""
    rank, _ = rank_world()
    if rank == 0 or others == "read":
        model = GPT(preset("tiny"), seed=SEED)
        model.load_state_dict(torch.load(checkpoint, weights_only=True))
    else:
        with torch.device("meta"):
            # shapes only: GPT's init computes nothing on meta
            model = GPT(preset("tiny"), seed=SEED)
        if others == "empty":
            # memory, never written; new tensors, so the tie is gone
            model.to_empty(device=CPU)
            model.lm_head.weight = model.wte.weight
    return with_tie_weights(model) if tie else model


# --- end before-prepare ---


# name: (cpu_ram_efficient_loading, what the other ranks hold, tie_weights)
LOADING_SETUPS = {
    "every rank reads": (False, "read", True),
    "rank 0 reads, others empty": (True, "empty", True),
    "rank 0 reads, others empty, no tie_weights": (True, "empty", False),
    "rank 0 reads, others on meta": (True, "meta", True),
}


def loading_row(env: dict[str, str], checkpoint: str, setup: str) -> dict:
    """``prepare`` one of ``LOADING_SETUPS``: the bytes this rank holds before, its peak
    during ``prepare`` (PyTorch's MemTracker), the collectives, the loaded weights
    against the checkpoint, the tie, and what one optimizer step changes."""
    from torch.distributed._tools.mem_tracker import MemTracker  # private, CPU-capable

    efficient, others, tie = LOADING_SETUPS[setup]
    env = dict(env, FSDP_CPU_RAM_EFFICIENT_LOADING=str(efficient).lower())
    model = model_before_prepare(checkpoint, others, tie)
    held_before = materialised_bytes(model)
    tracker = MemTracker()
    tracker.track_external(model)
    with CollectiveBytes() as comm, tracker:
        accelerator, model, optimizer = prepared_model(env, model)
    reference = torch.load(checkpoint, weights_only=True)
    loaded = {
        name: p.full_tensor()
        for name, p in model.named_parameters(remove_duplicate=False)
    }
    # distinct parameters
    held = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    stepped = optimizer_step_changes(accelerator, model, optimizer)
    return {
        "held before": held_before,
        "peak in prepare": tracker.get_tracker_snapshot("peak")[CPU]["Total"],
        "held after": materialised_bytes(model),
        "broadcasts": comm.counts().get("broadcast", 0),
        "broadcast bytes": comm.tensor_bytes().get("broadcast", 0),
        "scatters": comm.unknown.count("scatter_"),
        "max diff": max(
            (loaded[k] - v).abs().max().item() for k, v in reference.items()
        ),
        "tied": model.lm_head.weight is model.wte.weight,
        "optimizer holds": len(held),
        "held names": sorted(
            names.get(id(p), "(not in the model)") for p in held.values()
        )
        if len(held) < 4
        else None,
        **stepped,
    }


def optimizer_step_changes(accelerator, model, optimizer) -> dict:
    """One step on a batch: how many of the model's parameters it changed on
    this rank."""
    before = {name: p.to_local().clone() for name, p in model.named_parameters()}
    x = torch.randint(
        0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2)
    )
    _, loss = model(x, x)
    accelerator.backward(loss)
    optimizer.step()
    changed = [
        n
        for n, p in model.named_parameters()
        if not torch.equal(before[n], p.to_local())
    ]
    return {"parameters": len(before), "changed by a step": len(changed)}


def tour(envs: dict[str, dict[str, str]], checkpoint: str, save_root: str) -> dict:
    """Everything the page shows, in one launch: each config's prepared model, then each
    loading setup with the first config's variables."""
    configs = {
        name: inspect_config(env, str(Path(save_root) / name))
        for name, env in envs.items()
    }
    first = next(iter(envs.values()))
    return {
        "configs": configs,
        "loading": {s: loading_row(first, checkpoint, s) for s in LOADING_SETUPS},
    }


def _resident_bytes() -> int:
    """This process's resident set, from /proc (Linux): the RAM its pages occupy."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _resident_steps(name: str) -> dict:
    if name != "tiny":
        _resident_steps("tiny")  # first use loads code and kernels: not the model's RAM
    rss = [_resident_bytes()]
    with torch.device("meta"):
        model = GPT(preset(name), seed=SEED)
    model.to_empty(device=CPU)  # what rank 1 holds under "empty": allocated, unwritten
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rss.append(_resident_bytes())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)  # what reading the file would do: every page written
    rss.append(_resident_bytes())
    model.to("meta")  # what fsdp2_prepare_model does next: the storage is freed
    rss.append(_resident_bytes())
    return {
        "model bytes": model_bytes,
        "after to_empty": rss[1] - rss[0],
        "after writing": rss[2] - rss[0],
        "after to meta": rss[3] - rss[0],
    }


def resident_cost(name: str = "shakespeare") -> dict:
    """What the uninitialised model of the "empty" setup costs in RAM: the growth of
    the resident set (not PyTorch's allocation count) after ``to_empty``, after writing
    every parameter, and after the move to ``meta``, in a fresh process so that no
    freed, already-resident memory is reused."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_resident_steps, name).result(timeout=120)
