"""The run comparisons the lab tests use (``support.compare``) catch what a loss
tolerance cannot, shown on deliberately broken runs of the book's GPT on the CPU: a
gradient twice too large, and a bf16 policy dropped."""

import contextlib
import math

import pytest
import torch

from distlab.model import GPT, preset
from support.compare import computed_in_low_precision, mismatches

STEPS, WARMUP = 12, 4


def train(grad_scale: float = 1.0, dtype: torch.dtype | None = None) -> list[dict]:
    """A lab-like run: AdamW, the gradient clipped at 1, a linear warm-up, its records
    (step, loss, grad_norm). ``grad_scale`` 2 is the bug of summing two ranks'
    gradients instead of averaging them."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, cfg.vocab_size, (STEPS, 4, 33))
    records = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * min(1.0, (step + 1) / WARMUP)
        x, y = data[step, :, :-1], data[step, :, 1:]
        mode = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with mode:
            _, loss = model(x, y)
        loss.backward()
        for p in model.parameters():
            p.grad *= grad_scale
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"step": step, "loss": loss.item(), "grad_norm": norm.item()})
    return records


@pytest.fixture(scope="module")
def fp32():
    return train()


def test_a_gradient_twice_too_large_passes_a_loss_check_and_fails_ours(fp32):
    doubled = train(grad_scale=2.0)
    # the losses alone: within the CPU tests' 1e-5, the bug is invisible
    for got, ref in zip(doubled, fp32):
        assert math.isclose(got["loss"], ref["loss"], rel_tol=1e-5)
    # the gradient norm, past the warm-up: twice the reference, every step
    found = mismatches(doubled, fp32, rtol=1e-5, after=WARMUP)
    assert len(found) == STEPS - WARMUP and all("grad_norm" in f for f in found)
    assert not mismatches(train(), fp32, rtol=1e-5, after=WARMUP)  # a rerun agrees


def test_a_dropped_bf16_policy_fails_and_a_real_one_passes(fp32):
    bf16 = train(dtype=torch.bfloat16)
    assert computed_in_low_precision(bf16, fp32, at_least=1e-4)
    # the "bf16" run that kept fp32: equal to fp32, so it is caught
    assert not computed_in_low_precision(train(), fp32, at_least=1e-4)


def test_a_comparison_with_nothing_to_compare_fails(fp32):
    assert mismatches(fp32, fp32, rtol=1e-5, after=STEPS) == [
        f"no step at or after {STEPS} to compare"
    ]
    assert mismatches(fp32[:-1], fp32, rtol=1e-5)[0].startswith("steps logged")
