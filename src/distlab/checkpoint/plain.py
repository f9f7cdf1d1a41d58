"""Plain weights files: ``save_plain_weights`` (every lab's ``model.pt``),
``load_plain_weights`` (every lab's ``--init-from``) and ``to_plain`` (a sharded
checkpoint gathered into the one ``model.pt`` that lab 1 loads).

Plain files are loaded with ``weights_only=True``, which refuses anything but tensors
and plain containers, so a weights file cannot run code on the machine that loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distlab.checkpoint.folders import inspect_checkpoint
from distlab.checkpoint.state import (
    MODEL_PREFIX,
    error_line,
    one_process_is_meant,
    shape_mismatches,
)
from distlab.errors import UserError


def save_plain_weights(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Save a plain state dict (names to tensors) with every tensor on the CPU.

    ``torch.save`` keeps each tensor's device: a file of CUDA tensors loads only where
    that GPU exists, unless the loader passes ``map_location``. CPU tensors load on any
    machine, whichever lab and device wrote them. On the CPU, ``.cpu()`` returns the
    tensor itself, so a CPU run writes what ``torch.save(model.state_dict())`` wrote,
    tied matrix shared."""
    torch.save({name: tensor.detach().cpu() for name, tensor in state.items()}, path)


def load_plain_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load a plain state dict file (a lab's model.pt, or a converted checkpoint) into
    ``model``, an unwrapped model. Tensors only: ``weights_only=True`` runs no code from
    the file."""
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
        raise UserError(
            f"--init-from {path} is not a weights file ({error_line(err)})"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise UserError(f"--init-from {path} is not a state dict (names to tensors)")
    here = {k: v.shape for k, v in model.state_dict().items()}
    if problems := shape_mismatches(
        {k: v.shape for k, v in state.items()}, here, ("in the file", "in the model")
    ):
        raise UserError(f"--init-from {path} does not fit this model: {problems}")
    model.load_state_dict(state)


def to_plain(checkpoint: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """Gather a checkpoint's model into one plain state dict in this one process, check
    that it loads into the plain GPT, and save it to ``out``. Optimizer and RNG are
    left behind."""
    import torch.distributed.checkpoint as dcp

    from distlab.model import GPT, preset

    train_state, metadata = inspect_checkpoint(checkpoint)
    # full-size empty tensors: DCP fills each from whichever shard files hold its pieces
    weights = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(MODEL_PREFIX)
    }
    with one_process_is_meant():  # no process group here, on purpose
        dcp.load(weights, checkpoint_id=checkpoint, no_dist=True)
    weights = {k[len(MODEL_PREFIX) :]: v for k, v in weights.items()}
    plain = GPT(
        preset(
            train_state["config"]["preset"], vocab_size=weights["wte.weight"].shape[0]
        )
    )
    plain.load_state_dict(weights)  # strict: every key, every shape
    torch.save(plain.state_dict(), out)
    return plain.state_dict()
