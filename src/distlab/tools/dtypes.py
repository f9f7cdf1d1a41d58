"""Which dtype each operator really ran in: the check for a mixed-precision setup.

    with OpDtypes() as ops:
        model(x, y)[1].backward()
    # [{"phase": "forward", "op": "aten.addmm", "dtypes": "bf16 -> bf16"}, ...]
    ops.rows()

A ``TorchDispatchMode`` sees every ATen operator (and every c10d collective) with the
tensors it is given and returns, after autocast and FSDP2's casts have had their say, so
it reports what ran, not what a policy intends. Kernels may accumulate in a wider type
inside (a bf16 matrix product sums in fp32); what this shows is what they read
and write.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SHORT = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}
# bookkeeping that moves no numbers: views, allocations, the profiler's ranges
SKIP = {
    "aten.view",
    "aten._unsafe_view",
    "aten.t",
    "aten.transpose",
    "aten.split",
    "aten.split_with_sizes",
}
SKIP |= {"aten.as_strided", "aten.detach", "aten.empty", "aten.arange"}


def _dtypes(tree) -> str:
    """The dtypes of the tensors in ``tree``, a run of equal ones written once: "bf16,
    fp32"."""
    names = [
        SHORT.get(t.dtype, str(t.dtype).removeprefix("torch."))
        for t in tree_leaves(tree)
        if torch.is_tensor(t)
    ]
    return ", ".join(
        name for i, name in enumerate(names) if i == 0 or name != names[i - 1]
    )


class OpDtypes(TorchDispatchMode):
    """Record each distinct (phase, operator, input dtypes -> output dtypes) once,
    in order."""

    def __init__(self):
        super().__init__()
        self.seen: dict[tuple[str, str, str], None] = {}  # an ordered set
        # a name for what runs now ("optimizer"); None: forward or backward
        self.phase: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = (
            str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        )
        if name not in SKIP and not name.startswith("profiler."):
            phase = self.phase or (
                "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            )
            self.seen[
                (
                    phase,
                    name,
                    f"{_dtypes((args, kwargs))} -> {_dtypes(out) or '(in place)'}",
                )
            ] = None
        return out

    def rows(self) -> list[dict[str, str]]:
        return [
            {"phase": phase, "op": op, "dtypes": dtypes}
            for phase, op, dtypes in self.seen
        ]
