"""DDP in practice, exercise 5: an evaluation that counts every sample exactly once."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from torch.utils.data import TensorDataset

from distlab.exercises._common import on_ranks, passed, require_callable
from distlab.tools.exact_eval import eval_data, one_process_mean

# (ranks, samples): padding on 2 ranks; and 3 ranks with 2 samples, where rank 2 holds
# nothing but padding
CASES = ((2, 5), (3, 2))


def _evaluate_on_rank(evaluate: Callable, n: int) -> float:
    model, dataset = eval_data(n)
    return float(evaluate(model, dataset))


def _padded_mean(n: int, world_size: int) -> float:
    """What summing over DistributedSampler's padded shards gives: the first samples
    counted twice."""
    model, dataset = eval_data(n)
    total = -(-n // world_size) * world_size
    # shuffle off: the order 0..n-1, then its start again
    padded = [i % n for i in range(total)]
    x, y = dataset.tensors
    return one_process_mean(model, TensorDataset(x[padded], y[padded]))


def check_exact_evaluation(evaluate: Callable) -> None:
    """``evaluate(model, dataset)`` must return, on every rank, the mean of
    ``per_sample_loss`` over every sample of ``dataset`` once: one process's mean, to
    1e-6 relative."""
    require_callable(evaluate, "evaluate", "def evaluate(model, dataset): ...")
    for nprocs, n in CASES:
        model, dataset = eval_data(n)
        want = one_process_mean(model, dataset)
        got = on_ranks(
            functools.partial(_evaluate_on_rank, evaluate, n), nprocs, "your evaluate"
        )
        for rank, value in enumerate(got):
            if math.isclose(value, want, rel_tol=1e-6):
                continue
            hint = ""
            if math.isclose(value, _padded_mean(n, nprocs), rel_tol=1e-6):
                hint = (
                    ": that is the mean over DistributedSampler's padded shards, "
                    "repeats included"
                )
            raise AssertionError(
                f"{n} samples on {nprocs} ranks: rank {rank} returned {value:.6g}; "
                f"one process's mean is {want:.6g}{hint}"
            )
    cases = " and ".join(f"{n} samples on {nprocs} ranks" for nprocs, n in CASES)
    passed(f"one process's mean on every rank ({cases})")
