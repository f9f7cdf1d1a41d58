"""What ``torch.compile`` does to a DDP model: how many graphs the backend was handed,
what Dynamo's DDPOptimizer said when it split the graph at DDP's bucket boundaries, the
graph breaks, and DDP's own buckets after its rebuild.

    report = ddp_optimizer_report(model, wrap=DDP, loss_of=lambda m: m(x).sum())

Runs two steps with the ``aot_eager`` backend by default (Dynamo and AOTAutograd, no
code generation: seconds, not minutes, on a CPU). DDPOptimizer is Dynamo's
(torch/_dynamo/backends/distributed.py, "Note [DDPOptimizer]"), on by default
(``torch._dynamo.config.optimize_ddp``).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import torch
import torch.nn as nn


def ddp_optimizer_report(
    model: nn.Module,
    wrap: Callable[[nn.Module], nn.Module],
    loss_of: Callable[[nn.Module], torch.Tensor],
    compile_first: bool = False,
    backend: str = "aot_eager",
) -> dict:
    """Two steps of ``torch.compile(wrap(model))`` (or ``wrap(torch.compile(model))``
    with ``compile_first``): the graphs compiled, DDPOptimizer's log lines, the graph
    breaks, DDP's bucket sizes after its rebuild and the first step's seconds; or the
    error that stopped the compile."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)  # counts the graphs it compiles
    if compile_first:
        model = torch.compile(model, backend=counter)
    ddp = wrap(model)
    step = ddp if compile_first else torch.compile(ddp, backend=counter)
    said = _LogLines()
    dynamo_log = logging.getLogger("torch._dynamo.backends.distributed")
    level, dynamo_log.level = dynamo_log.level, logging.INFO
    dynamo_log.addHandler(said)
    seconds = []
    try:
        for _ in range(2):
            start = time.perf_counter()
            loss_of(step).backward()
            seconds.append(time.perf_counter() - start)
    except Exception as err:  # noqa: BLE001 - the report says what stopped the compile
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    finally:
        dynamo_log.removeHandler(said)
        dynamo_log.setLevel(level)
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
        "graphs": counter.frame_count,
        "ddp_optimizer": [
            line.strip() for line in said.lines if "DDPOptimizer" in line
        ],
        "ddp_buckets": [
            b.buffer().numel() * b.buffer().element_size() for b in buckets
        ],
        "graph_breaks": {
            _explanation(reason): n for reason, n in counters["graph_break"].items()
        },
        "first_step_s": seconds[0],
    }


class _LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _explanation(reason: str) -> str:
    """The line of a Dynamo graph-break reason that says what it could not trace."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    why = next(
        (
            line.removeprefix("Explanation: ")
            for line in lines
            if line.startswith("Explanation:")
        ),
        lines[0],
    )
    return re.sub(r" in file `[^`]*`", "", why)  # not this machine's paths
