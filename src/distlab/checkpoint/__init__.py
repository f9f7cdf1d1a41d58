"""Checkpoints for labs 1-5: save, resume on any number of ranks, convert to one
plain file.

    checkpoints.py  Checkpoints: save every --checkpoint-every steps, resume with
                    --resume (DCP)
    state.py        TrainingState, what DCP saves: model, optimizer, each rank's RNG;
                    MUST_MATCH
    folders.py      the step_NNNNNN folders: finished, latest, resume_point, prune,
                    inspect_checkpoint
    plain.py        save_plain_weights (model.pt, CPU tensors), load_plain_weights
                    (every lab's --init-from) and to_plain (checkpoint -> model.pt)
    preemption.py   Preemption: SIGTERM/SIGUSR1 -> a checkpoint at the end of the
                    step on every rank, then stop (--resume auto goes on)
    __main__.py     python -m distlab.checkpoint to-plain CHECKPOINT OUT.pt

torch.distributed.checkpoint (DCP) is imported inside the functions that use it: every
lab imports this package for load_plain_weights, and importing DCP costs about a second.
"""

from distlab.checkpoint.checkpoints import Checkpoints
from distlab.checkpoint.folders import (
    finished,
    inspect_checkpoint,
    keep_earlier_metrics,
    latest,
    prune,
    resume_point,
)
from distlab.checkpoint.plain import load_plain_weights, save_plain_weights, to_plain
from distlab.checkpoint.preemption import Preemption
from distlab.checkpoint.state import MUST_MATCH, TrainingState, rng_states

__all__ = [
    "MUST_MATCH",
    "Checkpoints",
    "Preemption",
    "TrainingState",
    "finished",
    "inspect_checkpoint",
    "keep_earlier_metrics",
    "latest",
    "load_plain_weights",
    "prune",
    "resume_point",
    "rng_states",
    "save_plain_weights",
    "to_plain",
]
