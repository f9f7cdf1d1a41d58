"""Hugging Face Accelerate for lab 6: build the Accelerator, and check it gave what
was asked.

Accelerate decides a lot from the environment and falls back quietly when it cannot do
what it was asked (each fallback is reproduced in the Accelerate chapter):

- without ``cpu=True`` on a machine with no GPU, each of N launched processes makes a
  one-process Accelerator: N models train unsynchronised, with no error;
- its FSDP plugin is only taken on accelerators: on CPU ranks it wraps the model in DDP
  instead.

So the device choice still comes from ``distlab.runtime`` (the one place that knows
about CPU vs GPU), and ``check_processes`` / ``check_strategy`` turn each fallback into
an error. Lab 6 builds its Accelerator with ``checked_accelerator``
(``make_accelerator`` between the checks that can run before training), hands it the
model with ``prepare``, and calls ``check_strategy`` on what comes back.

With ``--fsdp`` the lab shards the model itself, checkpoint first
(``parallel.apply_fsdp``), on GPUs as on CPU ranks: Accelerate 1.15's plugin, left to
shard, puts the FSDP2 unit inside the checkpoint wrapper and, given
``mixed_precision="bf16"``, reduces gradients in bf16 (the chapter shows both on
CPU ranks).
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from distlab.checkpoint import keep_earlier_metrics, prune, resume_point
from distlab.checkpoint.folders import PREEMPTED, save_due
from distlab.errors import UserError
from distlab.runtime import backend_for


def mixed_precision_for(dtype: str, fsdp: bool) -> str:
    """Accelerate's ``mixed_precision`` for lab 6's ``--dtype``: bf16 autocast under DDP
    (as labs 2-3), but "no" with ``--fsdp``, where FSDP2's ``MixedPrecisionPolicy`` from
    ``apply_fsdp`` (bf16 compute, fp32 reduction) is the one mechanism, as in labs 4-5.
    Given "bf16", the FSDP2 plugin would build a policy of its own that reduces in bf16
    and returns bf16 outputs (``set_mixed_precision`` in
    accelerate/utils/dataclasses.py)."""
    return "no" if dtype == "fp32" or fsdp else dtype


def fsdp2_plugin():
    """Accelerate's FSDP2 mode for a model the lab has already sharded.

    ``prepare`` leaves an ``FSDPModule`` as it is (``fsdp2_prepare_model`` in
    accelerate/utils/fsdp_utils.py returns it untouched) and maps the optimizer onto its
    parameters; the mode makes ``accumulate`` skip the reduce-scatter between
    micro-batches (``set_requires_gradient_sync``) and ``save_state`` write sharded
    files. Every field left unset is read from the launcher's ``FSDP_*`` variables, so
    the two that would change the model are set: no second checkpoint wrapper, no
    auto-wrap of its own.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        activation_checkpointing=False,
        auto_wrap_policy="no_wrap",
        state_dict_type="SHARDED_STATE_DICT",
    )


def make_accelerator(
    device: torch.device,
    dtype: str,
    accum_steps: int,
    sync_each_batch: bool,
    timeout_s: float,
    fsdp: bool,
):
    """An Accelerator on ``device`` (from ``runtime.pick_device``) with ``accum_steps``
    micro-batches per optimizer step, a process-group timeout, bf16 autocast for
    ``dtype`` bf16 without ``fsdp``, and with ``fsdp`` on a GPU, Accelerate's FSDP2 mode
    (``fsdp2_plugin``). On CPU there is no FSDP2 mode to ask for (it would give DDP);
    the caller keeps the model out of ``prepare``.
    """
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    return Accelerator(
        # without it, CPU processes never form a group (no error either)
        cpu=device.type == "cpu",
        mixed_precision=mixed_precision_for(dtype, fsdp),
        # sync_with_dataloader: our batches come from TokenData, not a DataLoader;
        # count micro-batches
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=accum_steps,
            sync_each_batch=sync_each_batch,
            sync_with_dataloader=False,
        ),
        # Accelerate picks the backend (gloo with cpu=True, NCCL on GPUs);
        # check_processes checks it
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))],
        fsdp_plugin=fsdp2_plugin() if fsdp and device.type == "cuda" else None,
    )


def check_fsdp_request(cfg, world_size: int, device: torch.device) -> None:
    """Refuse the FSDP runs this lab cannot give as asked, before any process
    group exists."""
    if cfg.fsdp and world_size == 1:
        raise UserError(
            "--fsdp shards over ranks and one process has none: launch 2 or "
            "more, or drop --fsdp"
        )
    if cfg.fsdp and (cfg.checkpoint_every or cfg.resume) and device.type != "cuda":
        # on CPU the sharded model is kept out of prepare: save_state writes no model it
        # was not given, and the optimizer from rank 0 alone: half of it
        raise UserError(
            "save_state cannot save a model Accelerate was not given (--fsdp on "
            "CPU ranks): "
            "use lab 5's sharded checkpoints, or drop --checkpoint-every/--resume"
        )


def launched_processes() -> int:
    """How many processes the launcher started (torchrun and ``accelerate launch`` set
    WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def check_processes(accelerator) -> None:
    """Fail when the launcher started N processes but Accelerate made N groups
    of one."""
    launched = launched_processes()
    if accelerator.num_processes != launched:
        raise UserError(
            f"the launcher started {launched} processes but Accelerate sees "
            f"{accelerator.num_processes} "
            f"({accelerator.distributed_type}, {accelerator.device}): each "
            "process would train its own "
            "model. On CPU ranks the Accelerator needs cpu=True (this lab "
            "passes it for --device cpu)"
        )
    want = backend_for(accelerator.device)
    # a backend string may name one per device ("cuda:nccl,cpu:gloo": Accelerate's
    # when FSDP offloads or saves a full state dict)
    if launched > 1 and want not in str(accelerator.state.backend):
        raise UserError(
            f"Accelerate chose the {accelerator.state.backend} backend; "
            f"{accelerator.device} needs {want}"
        )


def checked_accelerator(cfg, world_size: int, device: torch.device, accum_steps: int):
    """Lab 6's Accelerator, ``make_accelerator`` from its ``cfg``, between two checks:
    the FSDP runs it cannot give stop before any process group exists, and the group
    Accelerate made must hold every launched process."""
    # FSDP that cannot be given stops here, on every rank
    check_fsdp_request(cfg, world_size, device)
    accelerator = make_accelerator(
        device,
        cfg.dtype,
        accum_steps,
        cfg.sync_every_micro_batch,
        cfg.timeout_s,
        cfg.fsdp,
    )
    # N launched processes must be one group of N, not N groups of one
    check_processes(accelerator)
    return accelerator


def launch_report(accelerator, strategy: str) -> str:
    """One line for the run's start: the processes Accelerate sees against those
    launched, its mode, and what trains (``check_strategy``'s answer)."""
    return (
        f"accelerate: {accelerator.num_processes} process(es) of "
        f"{launched_processes()} launched, "
        f"{accelerator.distributed_type}, training with {strategy}"
    )


def prepare(accelerator, model: nn.Module, optimizer, fsdp: bool):
    """``accelerator.prepare`` as lab 6 needs it; returns the model and the optimizer to
    train with.

    Model and optimizer go in together (DDP on N ranks, nothing on one process, and in
    FSDP2 mode on GPUs the lab's own units kept), except with ``fsdp`` on CPU ranks:
    there Accelerate has no FSDP2 mode, so the sharded model stays out and only the
    optimizer is prepared (the Accelerate chapter shows what that costs).
    """
    # CPU: no FSDP2 mode (prepare would wrap DDP round it)
    if fsdp and not accelerator.is_fsdp2:
        # the model is not given to Accelerate
        return model, accelerator.prepare(optimizer)
    # DDP on N ranks, nothing on one process; in FSDP2 mode (GPUs) prepare keeps our
    # units. Together: Accelerate's FSDP2 mode refuses them apart (it maps the optimizer
    # onto the shards)
    return accelerator.prepare(model, optimizer)


def strategy_of(model: nn.Module) -> str:
    """What really trains: ``fsdp2`` (DTensor parameters), ``ddp`` (a DDP wrapper)
    or ``single``."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "fsdp2"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    return "single"


def check_strategy(model: nn.Module, accelerator, fsdp: bool) -> str:
    """The strategy in use after ``prepare``; an error if it is not the one
    asked for."""
    # When Accelerate wraps DDP (prepare_model, accelerate/accelerator.py): on CPU ranks
    # (MULTI_CPU) always, one process under torchrun included; on GPUs (MULTI_GPU) only
    # with several processes (``multi_device`` needs ``use_distributed``, num_processes
    # > 1, in state.py). Seen on an H100: lab 6 under torchrun with one process
    # trains unwrapped.
    kind = accelerator.distributed_type  # DistributedType is a str enum
    wraps_ddp = kind == "MULTI_CPU" or (kind != "NO" and accelerator.num_processes > 1)
    want = "fsdp2" if fsdp else ("ddp" if wraps_ddp else "single")
    got = strategy_of(model)
    if got != want:
        raise UserError(
            f"asked for {want} but the prepared model is {got} "
            f"(Accelerate: {accelerator.distributed_type} on {accelerator.device})"
        )
    return got


class Progress:
    """The step to go on from. Registered with the Accelerator, so save_state and
    load_state carry it next to the model, optimizer and each rank's RNG (our data is
    indexed by step)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


# save_state's name for the first registered object: Progress
PROGRESS_FILE = "custom_checkpoint_0.pkl"


class AcceleratorCheckpoints:
    """``accelerator.save_state`` to ``OUT/checkpoints/step_NNNNNN`` and
    ``load_state`` back.

    Accelerate writes the model and optimizer once (rank 0) under DDP and sharded under
    its FSDP plugin, plus one RNG file per rank. A folder gets its final name only when
    every rank has written, so ``latest`` never picks a half-written one.
    """

    def __init__(self, cfg, accelerator):
        self.cfg, self.accelerator = cfg, accelerator
        self.dir = Path(cfg.out) / "checkpoints"
        self.progress = Progress()
        accelerator.register_for_checkpointing(self.progress)

    def maybe_save(self, step: int, now: bool = False) -> None:
        """Call after optimizer step ``step``; saves every ``cfg.checkpoint_every``
        steps, and ``now`` (a preemption: ``Preemption.requested()``)."""
        if now or save_due(step, self.cfg.checkpoint_every):
            self.save(step + 1)
        if now and self.accelerator.is_main_process:
            print(PREEMPTED.format(steps=step + 1), flush=True)

    def save(self, steps_done: int) -> Path:
        acc = self.accelerator
        final = self.dir / f"step_{steps_done:06d}"
        partial = final.with_name(final.name + ".partial")
        if acc.is_main_process:
            # left behind by a run killed mid-save
            shutil.rmtree(partial, ignore_errors=True)
        acc.wait_for_everyone()
        self.progress.step = steps_done
        acc.save_state(str(partial))
        acc.wait_for_everyone()  # every rank's RNG file is in
        if acc.is_main_process:
            # a rerun into the same OUT replaces it
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            removed = prune(self.dir, self.cfg.keep_checkpoints, holds=(PROGRESS_FILE,))
            print(
                f"checkpoint: {final} ({len(list(final.iterdir()))} files)"
                + (
                    f"; removed {', '.join(p.name for p in removed)}" if removed else ""
                ),
                flush=True,
            )
        acc.wait_for_everyone()
        return final

    def resume(self) -> int:
        """Load ``cfg.resume`` (a step folder, "latest" or "auto") and return the step
        to run next."""
        if self.cfg.resume and self.cfg.init_from:
            raise UserError(
                "--resume and --init-from both given: a checkpoint brings its "
                "own weights"
            )
        path = resume_point(self.cfg.resume, self.dir, holds=(PROGRESS_FILE,))
        if path is None:  # no --resume, or --resume auto before the first checkpoint
            return 0
        if not path.is_dir():
            raise UserError(f"--resume {self.cfg.resume}: no such checkpoint folder")
        # model, optimizer, this rank's RNG, progress
        self.accelerator.load_state(str(path))
        if self.accelerator.is_main_process:
            print(f"resumed from {path} at step {self.progress.step}", flush=True)
            keep_earlier_metrics(self.cfg.out, self.progress.step)
        return self.progress.step
