"""Activation checkpointing, exercise 2: a selective policy that keeps only the
attention output."""

from __future__ import annotations

from collections.abc import Callable

import torch

from distlab.chapters.activation_checkpointing import (
    build,
    check_policy_saves,
    gradients,
)
from distlab.exercises._common import passed, require_callable
from distlab.model import preset


def _is_attention(op_name: str) -> bool:
    # the attention kernel differs by device and build (flash on CPU, efficient or cuDNN
    # on GPUs)
    return "scaled_dot_product" in op_name


def check_attention_only_policy(policy: Callable, preset_name: str = "tiny") -> None:
    """``policy`` must save each block's attention output and recompute everything else,
    every matrix product included, without changing the gradients."""
    require_callable(
        policy,
        "policy",
        "save_ops_policy([...]) or def policy(ctx, op, *args, **kwargs): ...",
    )
    # a ValueError if it saves nothing at all
    saved = check_policy_saves(policy, preset_name)
    others = {op: k for op, k in saved.items() if not _is_attention(op)}
    if others:
        listed = ", ".join(f"{op} ({k}x)" for op, k in sorted(others.items()))
        raise AssertionError(
            f"your policy also saves {listed}: only the attention output may be kept; "
            "every matrix product must be recomputed"
        )
    n_blocks = preset(preset_name).n_layer
    attention = sum(saved.values())
    if attention != n_blocks:
        raise AssertionError(
            f"your policy saved {attention} attention outputs for {n_blocks} "
            "blocks; expected one per block"
        )
    # checkpointing changes when things are computed, never what: the gradients must
    # not move
    cfg = preset(preset_name)
    idx, targets = torch.randint(
        0,
        cfg.vocab_size,
        (2, 4, cfg.block_size),
        generator=torch.Generator().manual_seed(0),
    )
    want = gradients(build(preset_name), idx, targets)
    got = gradients(build(preset_name, "selective", policy=policy), idx, targets)
    diff = max((g - w).abs().max().item() for g, w in zip(got, want))
    if diff > 1e-7:
        raise AssertionError(
            "with your policy the gradients differ from no checkpointing by "
            f"{diff:.1e} "
            "(max abs): a policy may only choose what to keep, never change a result"
        )
    passed(
        f"your policy saves {attention} outputs of {', '.join(sorted(saved))} "
        "(one per block) and recomputes "
        f"every matrix product; gradients equal no checkpointing to {diff:.1e} "
        "(max abs, tolerance 1e-7)"
    )
