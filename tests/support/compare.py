"""Is a lab's run the reference's? The comparisons the lab tests (CPU and GPU) hold a
run to, built so they can fail on the two commonest bugs (review gpu.md #2, #3):

- a gradient N times too large or too small (a sum instead of a mean over ranks,
  accumulation not divided): AdamW normalises the update and clipping caps it, so the
  losses barely move; the gradient norm, which every lab logs, moves N times. Compare
  both, past the learning-rate warm-up where the schedule no longer hides a slow drift.
- a dropped bf16 policy: the run computes in fp32 and matches fp32 to the last bit, so
  a bf16 tolerance passes it. Require a bf16 run to differ from fp32.
"""

from __future__ import annotations

import math


def mismatches(
    run: list[dict], reference: list[dict], rtol: float, after: int = 0
) -> list[str]:
    """Where ``run``'s records (metrics.jsonl lines) part from ``reference``'s: the loss
    or the gradient norm of a step at or after ``after``, off by more than ``rtol``,
    relative. A step logged by one run and not the other is a mismatch too."""
    ref = {r["step"]: r for r in reference if r["step"] >= after}
    got = {r["step"]: r for r in run if r["step"] >= after}
    if set(ref) != set(got):
        return [f"steps logged: {sorted(got)} against {sorted(ref)}"]
    if not ref:
        return [f"no step at or after {after} to compare"]
    out = []
    for step in sorted(ref):
        for key in ("loss", "grad_norm"):
            a, b = got[step][key], ref[step][key]
            if not math.isclose(a, b, rel_tol=rtol, abs_tol=0.0):
                out.append(f"step {step} {key}: {a!r} against {b!r} (rtol {rtol})")
    return out


def precision_gap(run: list[dict], fp32: list[dict]) -> float:
    """The largest relative difference of the losses and gradient norms of a run and
    its fp32 twin (the norm parts first: bf16 moves it about 10x more than the loss
    over a few steps)."""
    ref = {r["step"]: r for r in fp32}
    return max(
        abs(r[key] - ref[r["step"]][key]) / abs(ref[r["step"]][key])
        for r in run
        for key in ("loss", "grad_norm")
    )


def computed_in_low_precision(
    run: list[dict], fp32: list[dict], at_least: float
) -> bool:
    """Did the run round as bf16 does? Its losses or gradient norms must part from
    fp32's by more than ``at_least`` somewhere (a run that kept fp32 matches it to the
    last bit on the CPU; on a GPU, within fp32's own run-to-run noise)."""
    return precision_gap(run, fp32) > at_least
