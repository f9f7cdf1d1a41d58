"""What a run writes: ``metrics.jsonl`` (a line per logged step) and ``summary.json``;
``LogWindow``, which decides the logged steps and times the steps between them; and
``largest_differences``, how a lab page holds one run's metrics to another's."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from distlab.checkpoint.folders import save_due
from distlab.errors import UserError
from distlab.runtime import synchronize


class RunLog:
    """Appends metric lines and writes the summary; only the main rank writes files."""

    def __init__(self, out_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.dir = Path(out_dir)
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.dir / "metrics.jsonl", "w")

    def log(self, **fields) -> None:
        if self.enabled:
            self._metrics.write(json.dumps(fields) + "\n")
            self._metrics.flush()  # a crashed run keeps every line it logged

    def summary(self, **fields) -> None:
        if self.enabled:
            (self.dir / "summary.json").write_text(json.dumps(fields, indent=2) + "\n")

    def close(self) -> None:
        if self.enabled:
            self._metrics.close()


class LogWindow:
    """The steps between two log points, timed with one host sync at each end.

    On a GPU the host only queues kernels. Reading a value back (``loss.item()``) or
    ``synchronize`` makes it wait until the queue has run, so a read every step leaves
    the GPU idle while Python prepares the next step. Between log points the lab keeps
    the loss and the gradient norm on the device; at a log point it reads them once and
    ``close`` turns them into the record: the loss of that step, the tokens/s of the
    whole window.

    Log points: every ``log_every``-th step, each of the first ``warmup`` steps of a
    start (allocation and compilation: they are timed alone and left out of
    ``tokens_per_s``), the steps that evaluate, the steps after which a checkpoint is
    saved (``checkpoint_every``: the save runs after the window has closed, so its
    seconds are in no window) and the last step. With ``log_every`` 1 every step is
    one.
    """

    def __init__(
        self,
        device: torch.device,
        tokens_per_step: int,
        start_step: int,
        steps: int,
        log_every: int,
        checkpoint_every: int = 0,
    ):
        if log_every < 1:
            raise UserError(f"--log-every must be 1 or more, got {log_every}")
        self.device, self.tokens_per_step, self.log_every = (
            device,
            tokens_per_step,
            log_every,
        )
        self.start_step, self.steps, self.warmup = start_step, steps, 2
        self.checkpoint_every = checkpoint_every
        # the first step of the open window; None: none is open
        self.first: int | None = None
        self.started = 0.0
        # the steps after warm-up, for the summary
        self.timed_steps, self.timed_seconds = 0, 0.0

    def open(self, step: int) -> None:
        """Call before each step: the first step after a log point starts the clock."""
        if self.first is None:
            # work queued before (an evaluation, a checkpoint) is not this window's
            synchronize(self.device)
            self.first, self.started = step, time.perf_counter()

    @classmethod
    def for_run(
        cls, cfg, device: torch.device, tokens_per_step: int, start_step: int
    ) -> LogWindow:
        """The window of a lab's run: its ``steps``, ``log_every`` and
        ``checkpoint_every`` read from the lab's config."""
        return cls(
            device,
            tokens_per_step,
            start_step,
            cfg.steps,
            cfg.log_every,
            cfg.checkpoint_every,
        )

    def is_log_point(self, step: int, evaluating: bool = False) -> bool:
        return (
            evaluating
            or save_due(step, self.checkpoint_every)
            or step == self.steps - 1
            or step < self.start_step + self.warmup
            or (step + 1) % self.log_every == 0
        )

    def close(self, step: int, loss: float, **fields) -> dict:
        """End the window at ``step``, a log point (one host sync), and return its
        record: the step, its ``loss``, ``fields`` (lr, grad_norm), then tokens/s and
        seconds per step over the window. A loss that is not finite ends the run here.
        """
        synchronize(self.device)
        seconds = time.perf_counter() - self.started
        n_steps, first = step - self.first + 1, self.first
        self.first = None
        if (
            first >= self.start_step + self.warmup
            or self.steps - self.start_step <= self.warmup
        ):
            self.timed_steps, self.timed_seconds = (
                self.timed_steps + n_steps,
                self.timed_seconds + seconds,
            )
        if not math.isfinite(loss):
            raise UserError(
                f"loss is {loss} at step {step}: training diverged (try a lower --lr)"
            )
        tokens_per_s = self.tokens_per_step * n_steps / seconds
        return {
            "step": step,
            "loss": loss,
            **fields,
            "tokens_per_s": tokens_per_s,
            "step_s": seconds / n_steps,
        }

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over the warmed-up steps; nan if no step ran."""
        return (
            self.tokens_per_step * self.timed_steps / (self.timed_seconds or math.nan)
        )


def read_metrics(out_dir: str | Path) -> list[dict]:
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_summary(out_dir: str | Path) -> dict:
    return json.loads((Path(out_dir) / "summary.json").read_text())


def largest_differences(
    run: list[dict], reference: list[dict], keys=("loss", "grad_norm")
) -> dict[str, float]:
    """The largest relative difference of each of ``keys`` between two runs'
    ``read_metrics`` records, step by step; the runs must have logged the same steps."""
    steps = [m["step"] for m in run], [m["step"] for m in reference]
    if steps[0] != steps[1]:
        raise ValueError(f"the runs logged different steps: {steps[0]} and {steps[1]}")
    return {
        key: max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(run, reference))
        for key in keys
    }
