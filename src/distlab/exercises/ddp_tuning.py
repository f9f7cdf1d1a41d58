"""DDP's flags and the learning rate, exercise 4: a learning rate scaled with the
global batch."""

from __future__ import annotations

import math
from collections.abc import Callable

from distlab.exercises._common import passed, require_callable

# (base_lr, base_batch, global_batch, rule, step, warmup_steps) -> the expected rate
CASES = (
    ((1e-3, 8, 8, "linear", 0, 0), 1e-3),
    ((1e-3, 8, 32, "linear", 10, 0), 4e-3),
    ((1e-3, 8, 32, "sqrt", 10, 0), 2e-3),
    ((3e-4, 256, 512, "sqrt", 99, 0), 3e-4 * math.sqrt(2)),
    # step 0 of 4 warm-up steps: a quarter of the peak 4e-3
    ((1e-3, 8, 32, "linear", 0, 4), 1e-3),
    ((1e-3, 8, 32, "linear", 3, 4), 4e-3),  # the last warm-up step reaches the peak
    ((1e-3, 8, 32, "sqrt", 1, 4), 1e-3),  # half of the peak 2e-3
    ((1e-3, 8, 32, "sqrt", 50, 4), 2e-3),
)
BAD_BATCHES = ((1e-3, 8, 12, "linear", 0, 0), (1e-3, 8, 0, "sqrt", 0, 0))


def check_scaled_lr(scaled_lr: Callable) -> None:
    """``scaled_lr(base_lr, base_batch, global_batch, rule, step, warmup_steps)`` must
    give the rule's rate (``linear``: x k, ``sqrt``: x sqrt(k), k = global_batch /
    base_batch), warmed up linearly over ``warmup_steps``, and raise ValueError for a
    batch that is not a multiple."""
    require_callable(
        scaled_lr,
        "scaled_lr",
        "def scaled_lr(base_lr, base_batch, global_batch, rule, step, "
        "warmup_steps): ...",
    )
    for args, want in CASES:
        got = scaled_lr(*args)
        if not math.isclose(got, want, rel_tol=1e-9):
            base_lr, base_batch, global_batch, rule, step, warmup = args
            hint = ""
            if warmup and math.isclose(
                got, want * warmup / (step + 1) * step / warmup, rel_tol=1e-9
            ):
                hint = (
                    ": the warm-up is one step behind (step s should give (s + 1) / "
                    "warmup_steps of the peak)"
                )
            raise AssertionError(
                f"scaled_lr{args} returned {got:.6g}; the {rule} rule from "
                f"{base_lr:g} at batch {base_batch} "
                f"to batch {global_batch}, step {step} of a {warmup}-step "
                f"warm-up, gives {want:.6g}{hint}"
            )
    for args in BAD_BATCHES:
        try:
            scaled_lr(*args)
        except ValueError:
            continue
        raise AssertionError(
            f"scaled_lr{args} returned a rate; a global batch of {args[2]} "
            "should raise ValueError"
        )
    passed(
        f"{len(CASES)} rates (linear and square root, with and without warm-up) "
        f"and {len(BAD_BATCHES)} bad batches"
    )
