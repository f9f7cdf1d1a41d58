"""Activation checkpointing past the defaults, exercise 2: offload only the large
saved tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch

from distlab.chapters.activation_checkpointing import build, gradients
from distlab.exercises._common import passed, require_callable
from distlab.model import preset


def _holds_storage(packed, ptr: int) -> bool:
    """Whether what a pack hook returned still holds the storage at ``ptr`` (nothing
    was moved)."""
    items = packed if isinstance(packed, (tuple, list)) else (packed,)
    for item in items:
        if isinstance(item, torch.Tensor) and item.untyped_storage().data_ptr() == ptr:
            return True
        if isinstance(item, torch.UntypedStorage) and item.data_ptr() == ptr:
            return True
    return False


def check_threshold_offload(
    make_hooks: Callable, min_bytes: int = 64 * 1024, preset_name: str = "tiny"
) -> None:
    """``make_hooks(model, min_bytes)`` must return ``(pack, unpack)`` for
    ``saved_tensors_hooks`` that move every saved storage of at least ``min_bytes``
    bytes off its tensor (to the host), leave smaller storages and the model's
    parameters in place, and change no gradient."""
    require_callable(
        make_hooks,
        "make_hooks",
        "def make_hooks(model, min_bytes): ... return pack, unpack",
    )
    cfg = preset(preset_name)
    idx, targets = torch.randint(
        0,
        cfg.vocab_size,
        (2, 4, cfg.block_size),
        generator=torch.Generator().manual_seed(0),
    )
    want = gradients(build(preset_name), idx, targets)
    model = build(preset_name)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    hooks = make_hooks(model, min_bytes)
    if not (isinstance(hooks, tuple) and len(hooks) == 2 and all(map(callable, hooks))):
        raise ValueError("make_hooks must return a pair of functions: (pack, unpack)")
    pack, unpack = hooks
    wrong: list[str] = []
    moved = kept = 0

    def checked_pack(t: torch.Tensor):
        nonlocal moved, kept
        ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        packed = pack(t)
        stayed = _holds_storage(packed, ptr)
        should_stay = ptr in params or nbytes < min_bytes
        if stayed != should_stay:
            what = (
                "a parameter"
                if ptr in params
                else f"a {tuple(t.shape)} tensor of a {nbytes:,}-byte storage"
            )
            wrong.append(f"{what} was {'left in place' if stayed else 'moved'}")
        moved += 0 if stayed else nbytes
        kept += nbytes if stayed else 0
        return packed

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(checked_pack, unpack):
        loss = model(idx, targets)[1]
    loss.backward()
    # the worse mistake first
    wrong.sort(key=lambda line: not line.startswith("a parameter"))
    if wrong:
        raise AssertionError(
            f"with min_bytes={min_bytes:,}: {wrong[0]}"
            + (f" (and {len(wrong) - 1} more such tensors)" if len(wrong) > 1 else "")
            + "; move storages of at least min_bytes, leave smaller ones and "
            "parameters where they are"
        )
    if moved == 0:
        raise AssertionError(
            "your hooks moved nothing: every activation storage was left in place"
        )
    got = [p.grad for p in model.parameters()]
    diff = max((g - w).abs().max().item() for g, w in zip(got, want))
    if diff != 0:
        raise AssertionError(
            f"with your hooks the gradients differ from no hooks by {diff:.1e} "
            "(max abs): an offload must "
            "bring back exactly what was saved (no dtype change, no lost view "
            "offsets or strides)"
        )
    passed(
        f"storages of at least {min_bytes:,} bytes were moved ({moved:,} bytes, "
        "counted per pack), "
        f"smaller ones and parameters stayed ({kept:,} bytes); gradients equal "
        "no hooks exactly"
    )
