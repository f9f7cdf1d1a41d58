"""Checkpoints for labs 2-5: save, resume on any number of ranks, convert to one file.

In a training script (labs 2-5 have exactly these lines; everything else lives here):

    checkpoints = Checkpoints(cfg, model, optimizer)  # after fully_shard and the optimizer
    start_step = checkpoints.resume()                 # 0, or where the --resume checkpoint stopped
    for step in range(start_step, cfg.steps):
        ...                                           # one optimizer step
        checkpoints.maybe_save(step)                  # every --checkpoint-every steps

``--resume latest`` insists on a checkpoint; ``--resume auto`` takes the latest one if there
is one and starts at step 0 if not, so the same command serves the first start and every
restart of a job that restarts itself (``torchrun --max-restarts``, a requeued SLURM job).

From a shell, a checkpoint becomes the plain ``model.pt`` that every lab loads (``--init-from``):

    python -m distlab.checkpoint to-plain runs/lab4/checkpoints/step_000200 model.pt

A checkpoint is a folder that ``torch.distributed.checkpoint`` (DCP) wrote, plus one JSON file:

    step_000200/             the state after 200 optimizer steps: step 200 runs next
        __0_0.distcp, ...    rank r's own shards, written by rank r, all ranks at once (a
                             DDP replica is written once, by one rank; RNG states by each)
        .metadata            which region of which global tensor lies where (rank 0, last)
        train_state.json     the step, and the config that fixes the LR schedule and the data

Only resume from checkpoints you trust: DCP's ``.metadata`` (and the optimizer's hyper-
parameters inside the shards) are Python pickles. Plain files are loaded with
``weights_only=True``, which refuses anything but tensors and plain containers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.errors import UserError

# torch.distributed.checkpoint (DCP) is imported inside the functions that use it: labs 1-3
# import this module for load_plain_weights alone, and importing DCP costs about a second

STATE_FILE = "train_state.json"
METADATA = ".metadata"  # DCP writes it last: a folder without it is not a finished checkpoint
MODEL_PREFIX = "app.model."  # DCP flattens {"app": {"model": {...}}} into dotted keys
# a resumed run must follow the very trajectory it left: these fix the model's shapes, the batch
# of every step (seed, global batch), the LR of every step (the cosine runs over `steps`) and
# AdamW's weight decay (the optimizer's hyper-parameters come back from the checkpoint)
MUST_MATCH = ("preset", "batch_size", "seed", "lr", "min_lr", "warmup_steps", "steps", "weight_decay")


def _one_line(err: BaseException) -> str:
    """``Type: first sentence`` of an error; for DCP's, the first failing rank's own error."""
    if getattr(err, "failures", None):  # DCP's CheckpointException: {rank: (error, traceback)}
        rank, (inner, _) = min(err.failures.items())
        return f"on rank {rank}, {_one_line(inner)}"
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first.split('. ')[0][:150]}"


def _mismatches(there: dict, here: dict, where: tuple[str, str]) -> str:
    """'' if both map the same names to the same shapes, else the first differences, in words."""
    problems = [
        f"{k} is {list(there[k])} {where[0]}, {list(here[k])} {where[1]}"
        for k in here
        if k in there and tuple(there[k]) != tuple(here[k])
    ]
    problems += [f"{k} is missing {where[0]}" for k in here if k not in there]
    problems += [f"{k} is not {where[1]}" for k in there if k not in here]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random number generator states (uint8 tensors)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


class TrainingState:
    """What DCP saves and loads: the model, the optimizer and this rank's RNG.

    DCP's ``Stateful`` protocol: ``dcp.save`` calls ``state_dict()``; ``dcp.load`` calls it for
    the tensors to fill in place, then hands the filled dict to ``load_state_dict()``.

    ``get_state_dict`` names the optimizer state by parameter (``optim.state.wte.weight.exp_avg``,
    not by position) and keeps FSDP2's DTensors, so DCP writes only each rank's shard and, on
    load, reads whichever saved pieces overlap this rank's new shard: 2 ranks' checkpoint
    loads on 1 or on 4. The RNG keys name the rank, so each rank saves and reads its own.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, with_rng: bool = True):
        self.model, self.optimizer, self.rank, self.with_rng = model, optimizer, rank, with_rng
        self.device = next(model.parameters()).device

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        if self.with_rng:
            state["rng"] = {f"rank{self.rank}": rng_states(self.device)}
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.with_rng:
            rng = state["rng"][f"rank{self.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)


def inspect_checkpoint(path: str | Path):
    """(train_state, DCP metadata) of a finished checkpoint, checked without loading a tensor:
    its files exist and none is shorter than the index says. Raises UserError naming the file."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"no checkpoint at {path} (no such folder)")
    for name in (METADATA, STATE_FILE):
        if not (path / name).is_file():
            raise UserError(f"{path / name} is missing: {path} is not a finished checkpoint")
    try:
        train_state = json.loads((path / STATE_FILE).read_text())
    except ValueError as err:
        raise UserError(f"{path / STATE_FILE} is unreadable ({_one_line(err)})") from None
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # a truncated pickle raises EOFError, UnpicklingError, ...
        raise UserError(f"{path / METADATA} is unreadable ({_one_line(err)}): the checkpoint is damaged") from None
    needed: dict[str, int] = {}  # file -> bytes the index points into
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise UserError(f"{file} is missing: the checkpoint is incomplete")
        if file.stat().st_size < size:
            raise UserError(
                f"{file} is truncated: {file.stat().st_size:,} bytes, its index ({METADATA}) needs {size:,}"
            )
    return train_state, metadata


def finished(checkpoint_dir: str | Path, holds: tuple[str, ...] = (METADATA, STATE_FILE)) -> list[Path]:
    """The finished checkpoints in ``checkpoint_dir``, oldest first: ``step_N`` folders holding
    the files ``holds`` names (``.partial`` folders never match)."""
    done = [
        p
        for p in Path(checkpoint_dir).glob("step_*")
        if p.name[5:].isdigit() and all((p / name).is_file() for name in holds)
    ]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest(checkpoint_dir: str | Path, holds: tuple[str, ...] = (METADATA, STATE_FILE)) -> Path | None:
    """The finished checkpoint with the most steps in ``checkpoint_dir``, or None."""
    return (finished(checkpoint_dir, holds) or [None])[-1]


def resume_point(
    resume: str, checkpoint_dir: str | Path, holds: tuple[str, ...] = (METADATA, STATE_FILE)
) -> Path | None:
    """The checkpoint ``--resume`` names: a folder, ``latest`` (there must be one) or ``auto``
    (the latest if there is one, else None: start at step 0). None for an empty ``resume``."""
    if not resume:
        return None
    if resume in ("latest", "auto"):
        found = latest(checkpoint_dir, holds)
        if found is None and resume == "latest":
            raise UserError(
                f"--resume latest: no finished checkpoint in {checkpoint_dir} "
                "(--resume auto starts from step 0 when there is none)"
            )
        return found
    return Path(resume)


def prune(checkpoint_dir: str | Path, keep: int, holds: tuple[str, ...] = (METADATA, STATE_FILE)) -> list[Path]:
    """Delete all but the ``keep`` newest finished checkpoints (keep 0: delete none); returns
    what it deleted. Unfinished ``.partial`` folders are left to the next save of their step."""
    done = finished(checkpoint_dir, holds)
    old = done[:-keep] if keep > 0 else []
    for path in old:
        shutil.rmtree(path)
    return old


def keep_earlier_metrics(out: str | Path, step: int) -> None:
    """On resume: the lab reopens OUT/metrics.jsonl for writing; keep the interrupted run's lines aside."""
    old = Path(out) / "metrics.jsonl"
    if old.is_file():
        kept = old.rename(old.with_name(f"metrics.before_step_{step:06d}.jsonl"))
        print(f"kept the earlier {old.name} as {kept.name}", flush=True)


class Checkpoints:
    """Saves a run to ``OUT/checkpoints/step_NNNNNN`` and resumes one (see the module doc)."""

    def __init__(self, cfg, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = next(model.parameters()).device
        self.dir = Path(cfg.out) / "checkpoints"

    # --- begin save ---
    def maybe_save(self, step: int) -> None:
        """Call after optimizer step ``step``; saves every ``cfg.checkpoint_every`` steps."""
        if self.cfg.checkpoint_every > 0 and (step + 1) % self.cfg.checkpoint_every == 0:
            self.save(step + 1)

    def save(self, steps_done: int) -> Path:
        """Every rank writes its shards at once; the folder gets its final name only when complete."""
        import torch.distributed.checkpoint as dcp

        final = self.dir / f"step_{steps_done:06d}"
        partial = final.with_name(final.name + ".partial")  # `latest` never picks this name
        start = time.perf_counter()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left behind by a run killed mid-save
            partial.mkdir(parents=True)
        dist.barrier()
        # returns on every rank after rank 0 has gathered the ranks' write results into .metadata
        dcp.save({"app": TrainingState(self.model, self.optimizer, self.rank)}, checkpoint_id=partial)
        if self.rank == 0:
            (partial / STATE_FILE).write_text(json.dumps(self._train_state(steps_done), indent=1) + "\n")
            if final.exists():  # a rerun into the same OUT replaces its old checkpoint
                shutil.rmtree(final)
            partial.rename(final)  # one step on one file system: complete, or not there at all
            size = sum(f.stat().st_size for f in final.iterdir())
            # only now, with a newer one complete, may the oldest go
            removed = prune(self.dir, self.cfg.keep_checkpoints)
            print(
                f"checkpoint: {final} ({size / 1e6:.2f} MB, one file per rank, {self.world_size} ranks) "
                f"in {time.perf_counter() - start:.2f} s"
                + (f"; removed {', '.join(p.name for p in removed)}" if removed else ""),
                flush=True,
            )
        dist.barrier()  # nobody goes on before the checkpoint has its final name
        return final

    def _train_state(self, steps_done: int) -> dict:
        cfg = self.cfg
        return {
            "step": steps_done,  # optimizer steps done, so the step that runs next
            "world_size": self.world_size,
            # lr_at(step) is a pure function of these, so restoring `step` restores the schedule
            "lr_schedule": {
                "lr": cfg.lr,
                "min_lr": cfg.min_lr,
                "warmup_steps": cfg.warmup_steps,
                "steps": cfg.steps,
                "last_lr": self.optimizer.param_groups[0]["lr"],
            },
            # the batch of step s is data.batch("train", s, global_batch, ..., seed): no loader state
            "data": {"split": "train", "next_step": steps_done, "global_batch": cfg.batch_size, "seed": cfg.seed},
            "rng": "per rank, in the shards: app.rng.rank<r>.cpu (and .cuda on GPUs)",
            "config": asdict(cfg),
            "torch": torch.__version__,
        }

    # --- end save ---

    # --- begin resume ---
    def resume(self) -> int:
        """Load ``cfg.resume`` (a step folder, "latest" or "auto") and return the step to run next.

        Without --resume (or with "auto" and no checkpoint yet), 0. Every rank calls it. Rank 0
        checks all it can before a tensor is loaded (files and their sizes, config, shapes) and
        passes the verdict on, so a bad checkpoint stops every rank with the same one-line error
        and nothing loaded.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        if not self.cfg.resume:
            return 0
        if self.cfg.init_from:
            raise UserError("--resume and --init-from both given: a checkpoint brings its own weights")
        verdict = [self._check() if self.rank == 0 else None]
        dist.broadcast_object_list(verdict, src=0)
        error, path, step, saved_world_size, saved_rng = verdict[0]
        if error:
            raise UserError(error)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun counts its restarts
        restarted = f" (torchrun restart {restart})" if restart != "0" else ""
        if path is None:  # --resume auto, and nothing saved yet
            if self.rank == 0:
                print(f"--resume auto: no checkpoint in {self.dir} yet, starting at step 0{restarted}", flush=True)
            return 0
        # a rank's RNG comes back only to the same rank of the same world size; else it is reseeded
        with_rng = saved_world_size == self.world_size and set(rng_states(self.device)) <= set(saved_rng)
        try:
            dcp.load({"app": TrainingState(self.model, self.optimizer, self.rank, with_rng)}, checkpoint_id=path)
        except (Exception, CheckpointException) as err:  # the latter holds every rank's failure
            # the files had the right sizes, so some bytes are damaged; the run ends here, so
            # whatever did load never trains
            raise UserError(f"loading checkpoint {path} failed ({_one_line(err)}): a shard file is damaged") from None
        if not with_rng:
            torch.manual_seed(self.cfg.seed + 1000 * step + self.rank)
        if self.rank == 0:
            print(
                f"resumed from {path} at step {step} (saved by {saved_world_size} ranks, now "
                f"{self.world_size})" + ("" if with_rng else "; RNG reseeded: seed + 1000*step + rank") + restarted,
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
                f"--{k.replace('_', '-')} is {saved.get(k)!r} there, {getattr(self.cfg, k)!r} here"
                for k in MUST_MATCH
                if saved.get(k) != getattr(self.cfg, k)
            ]
            if differ:
                raise UserError(
                    f"checkpoint {path} was saved by a different run: {'; '.join(differ)} (resume with the same values)"
                )
            # DTensor.shape is the global shape, the one DCP's index records; DCP's keys
            # never carry DDP's "module." prefix (get_state_dict drops it)
            here = {k.removeprefix("module."): v.shape for k, v in self.model.state_dict().items()}
            there = {
                k[len(MODEL_PREFIX) :]: m.size
                for k, m in metadata.state_dict_metadata.items()
                if k.startswith(MODEL_PREFIX)
            }
            if problems := _mismatches(there, here, ("there", "here")):
                raise UserError(f"checkpoint {path} does not fit this model: {problems}")
            rng = [k.rsplit(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("app.rng.rank0.")]
            return None, str(path), train_state["step"], train_state["world_size"], rng
        except UserError as err:
            return str(err), None, 0, 0, []
        except Exception as err:  # rank 0 must reach the broadcast, or the others wait for it
            return f"checkpoint {self.cfg.resume} is unreadable ({_one_line(err)})", None, 0, 0, []

    # --- end resume ---


def load_plain_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load a plain state dict file (a lab's model.pt, or a converted checkpoint) into ``model``,
    an unwrapped model. Tensors only: ``weights_only=True`` runs no code from the file."""
    path = Path(path)
    if path.is_dir():
        raise UserError(
            f"--init-from {path} is a folder; a sharded checkpoint becomes a file with "
            f"`python -m distlab.checkpoint to-plain {path} model.pt`"
        )
    if not path.is_file():
        raise UserError(f"--init-from {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"--init-from {path} is not a weights file ({_one_line(err)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"--init-from {path} is not a state dict (names to tensors)")
    here = {k: v.shape for k, v in model.state_dict().items()}
    if problems := _mismatches({k: v.shape for k, v in state.items()}, here, ("in the file", "in the model")):
        raise UserError(f"--init-from {path} does not fit this model: {problems}")
    model.load_state_dict(state)


def to_plain(checkpoint: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """Gather a checkpoint's model into one plain state dict in this one process, check that
    it loads into the plain GPT, and save it to ``out``. Optimizer and RNG are left behind."""
    import torch.distributed.checkpoint as dcp

    from distlab.model import GPT, preset

    train_state, metadata = inspect_checkpoint(checkpoint)
    # full-size empty tensors: DCP fills each from whichever shard files hold its pieces
    weights = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(MODEL_PREFIX)
    }
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: we mean it
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(weights, checkpoint_id=checkpoint, no_dist=True)
    weights = {k[len(MODEL_PREFIX) :]: v for k, v in weights.items()}
    plain = GPT(preset(train_state["config"]["preset"], vocab_size=weights["wte.weight"].shape[0]))
    plain.load_state_dict(weights)  # strict: every key, every shape
    torch.save(plain.state_dict(), out)
    return plain.state_dict()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("to-plain", help="write the model as one plain state dict file")
    convert.add_argument("checkpoint", help="a step_NNNNNN folder")
    convert.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(argv)
    weights = to_plain(args.checkpoint, args.out)
    print(
        f"wrote {args.out}: {len(weights)} tensors, "
        f"{sum(t.numel() for t in weights.values()):,} values (the tied head counted twice)"
    )


if __name__ == "__main__":
    from distlab.cli import run

    run(main, "python -m distlab.checkpoint")
