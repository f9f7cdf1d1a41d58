"""``Checkpoints``: save a run every ``--checkpoint-every`` steps and resume it
with ``--resume``.

In a training script (labs 1-5 have exactly these lines; everything else lives here):

    # after any wrapper (DDP, fully_shard) and the optimizer
    checkpoints = Checkpoints(cfg, model, optimizer)
    start_step = checkpoints.resume()     # 0, or where the --resume checkpoint stopped
    preemption = Preemption()             # notes SIGTERM and SIGUSR1 (preemption.py)
    for step in range(start_step, cfg.steps):
        ...                               # one optimizer step
        stop = preemption.requested()     # did any rank get a signal?
        checkpoints.maybe_save(step, now=stop)  # every --checkpoint-every steps, or now
        if stop:
            break

``--resume latest`` insists on a checkpoint; ``--resume auto`` takes the latest one if
there is one and starts at step 0 if not, so the same command serves the first start and
every restart of a job that restarts itself (``torchrun --max-restarts``, a requeued
SLURM job). Lab 1 has no process group: it is rank 0 of 1, the barriers and the
broadcast are skipped, and DCP writes and reads every piece in that one process.

A checkpoint is a folder that ``torch.distributed.checkpoint`` (DCP) wrote, plus one
JSON file:

    step_000200/             the state after 200 optimizer steps: step 200 runs next
        __0_0.distcp, ...    rank r's own shards, written by rank r, all ranks at once
                             (a DDP replica is written once, by one rank; RNG states
                             by each)
        .metadata            which region of which global tensor lies where (rank 0,
                             last)
        train_state.json     the step, and the config that fixes the LR schedule and
                             the data

Only resume from checkpoints you trust: DCP's ``.metadata`` (and the optimizer's hyper-
parameters inside the shards) are Python pickles.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.checkpoint.folders import (
    PREEMPTED,
    fsync_dir,
    inspect_checkpoint,
    keep_earlier_metrics,
    prune,
    resume_point,
    save_due,
    write_durably,
)
from distlab.checkpoint.state import (
    MODEL_PREFIX,
    MUST_MATCH,
    STATE_FILE,
    TrainingState,
    error_line,
    one_process_is_meant,
    rng_states,
    shape_mismatches,
)
from distlab.errors import UserError
from distlab.runtime import rank_world


@dataclass
class CheckpointConfig:
    """The fields ``Checkpoints`` reads, with small defaults: for saving and resuming
    outside a lab (tests, the chapters). A lab's Config has them all."""

    out: str
    preset: str = "tiny"
    batch_size: int = 16
    seed: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    steps: int = 10
    weight_decay: float = 0.1
    data: str = ""
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str = ""
    init_from: str = ""


def _barrier_if_grouped() -> None:
    # without a process group (lab 1) there is nobody to wait for
    if dist.is_initialized():
        dist.barrier()


class Checkpoints:
    """Saves a run to ``OUT/checkpoints/step_NNNNNN`` and resumes one (see the
    module doc)."""

    def __init__(self, cfg, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.rank, self.world_size = rank_world()  # (0, 1) in lab 1
        self.device = next(model.parameters()).device
        self.dir = Path(cfg.out) / "checkpoints"

    # --- begin save ---
    def maybe_save(self, step: int, now: bool = False) -> None:
        """Call after optimizer step ``step``; saves every ``cfg.checkpoint_every``
        steps, and ``now`` (a preemption: ``Preemption.requested()``)."""
        if now or save_due(step, self.cfg.checkpoint_every):
            self.save(step + 1)
        if now and self.rank == 0:
            print(PREEMPTED.format(steps=step + 1), flush=True)

    def save(self, steps_done: int) -> Path:
        """Every rank writes its shards at once; the folder gets its final name only
        when complete."""
        import torch.distributed.checkpoint as dcp

        final = self.dir / f"step_{steps_done:06d}"
        # `latest` never picks this name
        partial = final.with_name(final.name + ".partial")
        start = time.perf_counter()
        if self.rank == 0:
            # left behind by a run killed mid-save
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier_if_grouped()
        # returns on every rank after rank 0 has gathered the ranks' write results
        # into .metadata
        with one_process_is_meant():
            dcp.save(
                {"app": TrainingState(self.model, self.optimizer, self.rank)},
                checkpoint_id=partial,
            )
        if self.rank == 0:
            # DCP fsynced its shards and .metadata (FileSystemWriter's sync_files)
            write_durably(
                partial / STATE_FILE,
                json.dumps(self._train_state(steps_done), indent=1) + "\n",
            )
            if final.exists():  # a rerun into the same OUT replaces its old checkpoint
                shutil.rmtree(final)
            # one step on one file system: complete, or not there at all
            partial.rename(final)
            fsync_dir(self.dir)  # the new name survives a power cut
            size = sum(f.stat().st_size for f in final.iterdir())
            # only now, with a newer one complete, may the oldest go
            removed = prune(self.dir, self.cfg.keep_checkpoints)
            print(
                f"checkpoint: {final} ({size / 1e6:.2f} MB, one file per rank, "
                f"{self.world_size} "
                f"rank{'s' if self.world_size > 1 else ''}) in "
                f"{time.perf_counter() - start:.2f} s"
                + (
                    f"; removed {', '.join(p.name for p in removed)}" if removed else ""
                ),
                flush=True,
            )
        _barrier_if_grouped()  # nobody goes on before the checkpoint has its final name
        return final

    def _train_state(self, steps_done: int) -> dict:
        cfg = self.cfg
        return {
            "step": steps_done,  # optimizer steps done, so the step that runs next
            "world_size": self.world_size,
            # lr_at(step) is a pure function of these, so restoring `step` restores
            # the schedule
            "lr_schedule": {
                "lr": cfg.lr,
                "min_lr": cfg.min_lr,
                "warmup_steps": cfg.warmup_steps,
                "steps": cfg.steps,
                "last_lr": self.optimizer.param_groups[0]["lr"],
            },
            # the batch of step s is data.batch("train", s, global_batch, ..., seed): no
            # loader state
            "data": {
                "split": "train",
                "next_step": steps_done,
                "global_batch": cfg.batch_size,
                "seed": cfg.seed,
            },
            "rng": "per rank, in the shards: app.rng.rank<r>.cpu (and .cuda on GPUs)",
            "config": asdict(cfg),
            "torch": torch.__version__,
        }

    # --- end save ---

    # --- begin resume ---
    def resume(self) -> int:
        """Load ``cfg.resume`` (a step folder, "latest" or "auto") and return the step
        to run next.

        Without --resume (or with "auto" and no checkpoint yet), 0. Every rank calls it.
        Rank 0 checks all it can before a tensor is loaded (files and their sizes,
        config, shapes) and passes the verdict on, so a bad checkpoint stops every rank
        with the same one-line error and nothing loaded.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        if not self.cfg.resume:
            return 0
        if self.cfg.init_from:
            raise UserError(
                "--resume and --init-from both given: a checkpoint brings its "
                "own weights"
            )
        verdict = [self._check() if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(verdict, src=0)
        error, path, step, saved_world_size, saved_rng = verdict[0]
        if error:
            raise UserError(error)
        # torchrun counts its restarts
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        restarted = f" (torchrun restart {restart})" if restart != "0" else ""
        if path is None:  # --resume auto, and nothing saved yet
            if self.rank == 0:
                print(
                    f"--resume auto: no checkpoint in {self.dir} yet, starting "
                    f"at step 0{restarted}",
                    flush=True,
                )
            return 0
        # a rank's RNG comes back only to the same rank of the same world size; else it
        # is reseeded
        with_rng = saved_world_size == self.world_size and set(
            rng_states(self.device)
        ) <= set(saved_rng)
        try:
            with one_process_is_meant():
                dcp.load(
                    {
                        "app": TrainingState(
                            self.model, self.optimizer, self.rank, with_rng
                        )
                    },
                    checkpoint_id=path,
                )
        # the latter holds every rank's failure
        except (Exception, CheckpointException) as err:
            # the files had the right sizes, so some bytes are damaged; the run ends
            # here, so whatever did load never trains
            raise UserError(
                f"loading checkpoint {path} failed ({error_line(err)}): a shard "
                "file is damaged"
            ) from None
        if not with_rng:
            torch.manual_seed(self.cfg.seed + 1000 * step + self.rank)
        if self.rank == 0:
            print(
                f"resumed from {path} at step {step} (saved by "
                f"{saved_world_size} ranks, now "
                f"{self.world_size})"
                + ("" if with_rng else "; RNG reseeded: seed + 1000*step + rank")
                + restarted,
                flush=True,
            )
            keep_earlier_metrics(self.cfg.out, step)
        return step

    def _check(self) -> tuple:
        """On rank 0: (error or None, path, step, saved world size, saved RNG kinds)."""
        try:
            path = resume_point(self.cfg.resume, self.dir)
            if path is None:  # --resume auto with nothing saved yet: a fresh start
                return None, None, 0, 0, []
            train_state, metadata = inspect_checkpoint(path)
            saved = train_state.get("config", {})
            differ = [
                f"--{k.replace('_', '-')} is {saved.get(k)!r} there, "
                f"{getattr(self.cfg, k)!r} here"
                for k in MUST_MATCH
                if saved.get(k) != getattr(self.cfg, k)
            ]
            if differ:
                raise UserError(
                    f"checkpoint {path} was saved by a different run: "
                    f"{'; '.join(differ)} (resume with the same values)"
                )
            # DTensor.shape is the global shape, the one DCP's index records; DCP's keys
            # never carry DDP's "module." prefix (get_state_dict drops it)
            here = {
                k.removeprefix("module."): v.shape
                for k, v in self.model.state_dict().items()
            }
            there = {
                k[len(MODEL_PREFIX) :]: m.size
                for k, m in metadata.state_dict_metadata.items()
                if k.startswith(MODEL_PREFIX)
            }
            if problems := shape_mismatches(there, here, ("there", "here")):
                raise UserError(
                    f"checkpoint {path} does not fit this model: {problems}"
                )
            rng = [
                k.rsplit(".", 1)[1]
                for k in metadata.state_dict_metadata
                if k.startswith("app.rng.rank0.")
            ]
            return None, str(path), train_state["step"], train_state["world_size"], rng
        except UserError as err:
            return str(err), None, 0, 0, []
        # rank 0 must reach the broadcast, or the others wait for it
        except Exception as err:
            return (
                f"checkpoint {self.cfg.resume} is unreadable ({error_line(err)})",
                None,
                0,
                0,
                [],
            )

    # --- end resume ---
