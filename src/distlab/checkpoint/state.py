"""What a checkpoint holds: ``TrainingState`` (model, optimizer, each rank's RNG) for
DCP, the config fields a resumed run must share with the saved one, and the shared
error helpers."""

from __future__ import annotations

import contextlib
import warnings

import torch

STATE_FILE = "train_state.json"
# DCP writes it last: a folder without it is not a finished checkpoint
METADATA = ".metadata"
MODEL_PREFIX = "app.model."  # DCP flattens {"app": {"model": {...}}} into dotted keys
# a resumed run must follow the very trajectory it left: these fix the model's shapes,
# the batch of every step (seed, global batch), the LR of every step (the cosine runs
# over `steps`) and AdamW's weight decay (the optimizer's hyper-parameters come back
# from the checkpoint)
MUST_MATCH = (
    "preset",
    "batch_size",
    "seed",
    "lr",
    "min_lr",
    "warmup_steps",
    "steps",
    "weight_decay",
)


def error_line(err: BaseException) -> str:
    """``Type: first sentence`` of an error; for DCP's, the first failing rank's
    own error."""
    # DCP's CheckpointException: {rank: (error, traceback)}
    if getattr(err, "failures", None):
        rank, (inner, _) = min(err.failures.items())
        return f"on rank {rank}, {error_line(inner)}"
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first.split('. ')[0][:150]}"


def shape_mismatches(there: dict, here: dict, where: tuple[str, str]) -> str:
    """'' if both map the same names to the same shapes, else the first differences,
    in words."""
    problems = [
        f"{k} is {list(there[k])} {where[0]}, {list(here[k])} {where[1]}"
        for k in here
        if k in there and tuple(there[k]) != tuple(here[k])
    ]
    problems += [f"{k} is missing {where[0]}" for k in here if k not in there]
    problems += [f"{k} is not {where[1]}" for k in there if k not in here]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


@contextlib.contextmanager
def one_process_is_meant():
    """Silence DCP's warning that it saves or loads without a process group: lab 1 and
    ``to_plain`` run in one process on purpose (DCP then reads and writes every
    piece itself)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r".*assuming the intent is to (save|load) in a single process",
        )
        yield


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random number generator states (uint8 tensors)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


class TrainingState:
    """What DCP saves and loads: the model, the optimizer and this rank's RNG.

    DCP's ``Stateful`` protocol: ``dcp.save`` calls ``state_dict()``; ``dcp.load`` calls
    it for the tensors to fill in place, then hands the filled dict to
    ``load_state_dict()``.

    ``get_state_dict`` names the optimizer state by parameter
    (``optim.state.wte.weight.exp_avg``, not by position) and keeps FSDP2's DTensors, so
    DCP writes only each rank's shard and, on load, reads whichever saved pieces overlap
    this rank's new shard: 2 ranks' checkpoint loads on 1 or on 4. The RNG keys name the
    rank, so each rank saves and reads its own.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        with_rng: bool = True,
    ):
        self.model, self.optimizer, self.rank, self.with_rng = (
            model,
            optimizer,
            rank,
            with_rng,
        )
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

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        if self.with_rng:
            rng = state["rng"][f"rank{self.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)
