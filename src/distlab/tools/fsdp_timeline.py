"""Which FSDP2 units hold gathered parameters, operator by operator, and when each
all-gather was issued.

    units = fsdp_units(model)      # {"root": model, "blocks.0": ..., ...}
    with GatheredTimeline(units) as timeline:
        model(x, y)[1].backward()
    timeline.samples               # one Sample after every operator
    timeline.gathers               # one Gather per all-gather: unit, who issued it
    # the most held, and how far ahead each gather ran
    peak(timeline.samples); gather_leads(timeline)

A ``TorchDispatchMode`` sees every ATen operator and c10d collective on this thread (CPU
autograd runs backward on it too), and ``record_function``'s ranges as ``profiler``
operators. After each operator it reads FSDP2's own state (private: ``FSDPParamGroup``
in ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``), unit by unit:

- whole parameters: the group is unsharded; the bytes of the storages of its
  ``all_gather_outputs``;
- all-gather buffers: the flat output of an all-gather not yet copied out
  (``_all_gather_result``: a prefetch), and the one FSDP2 keeps after a forward copy-out
  so that the next unit's copy-in cannot overwrite it (``comm_ctx.all_gather_state``,
  see the note "Overlapping all-gather copy-in and all-gather" in that file).

An operator "computes with" a unit when one of its tensors shares storage with the
unit's whole parameters. An all-gather is named after FSDP2's range around it
(``FSDP::all_gather (blocks.3)``) and after the range that issued it (a unit's
pre-forward or pre-backward, a prefetch, or none: the user's ``unshard()``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# c10d ops FSDP2's all-gather uses
ALL_GATHERS = {"_allgather_base_", "allgather_into_tensor_coalesced_"}


@dataclass(frozen=True)
class Sample:
    phase: str  # "forward" or "backward"
    whole: int  # bytes of whole (unsharded) parameters held
    # bytes of all-gather output buffers held (pending, or kept for the next copy-in)
    buffers: int
    held: tuple[str, ...]  # units with whole parameters or a buffer
    computes: tuple[str, ...]  # units whose whole parameters this operator read


@dataclass(frozen=True)
class Gather:
    index: int  # position in ``samples`` of the collective
    unit: str
    phase: str
    # "own pre-forward", "own pre-backward", "forward prefetch", "backward
    # prefetch", "unshard()"
    issued_by: str


def fsdp_units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every FSDP2 unit under ``model`` by its name ("root" for the model itself), in
    module order."""
    from torch.distributed.fsdp import FSDPModule

    return {
        name or "root": m
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
    }


def _unit_of(range_name: str) -> str:
    """'FSDP::all_gather (blocks.3)' -> 'blocks.3'; FSDP2 names no module for
    the root."""
    return range_name[range_name.index("(") + 1 : -1] if "(" in range_name else "root"


def _issuer(ranges: list[str]) -> str:
    # the innermost range around the all-gather's own
    for name in reversed(ranges[:-1]):
        for prefix, who in (
            ("FSDP::forward_prefetch", "forward prefetch"),
            ("FSDP::backward_prefetch", "backward prefetch"),
        ):
            if name.startswith(prefix):
                return who
        if name.startswith(("FSDP::pre_forward", "FSDP::pre_backward")):
            return "own " + name.removeprefix("FSDP::").split(" ")[0].replace("_", "-")
    return "unshard()"


class GatheredTimeline(TorchDispatchMode):
    """While open, a ``Sample`` after every operator and a ``Gather`` for
    every all-gather."""

    def __init__(self, units: dict[str, torch.nn.Module]):
        super().__init__()
        self.groups = {
            name: m._get_fsdp_state()._fsdp_param_groups for name, m in units.items()
        }
        # shared by every unit
        self.comm_ctx = next(g for gs in self.groups.values() for g in gs).comm_ctx
        self.samples: list[Sample] = []
        self.gathers: list[Gather] = []
        self._ranges: list[str] = []  # record_function ranges open now, innermost last
        # id of an all-gather result -> its unit, to name a kept buffer
        self._owner: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if name == "_record_function_enter_new":
            self._ranges.append(args[0])
        elif name == "_record_function_exit" and self._ranges:
            self._ranges.pop()
        elif (
            name in ALL_GATHERS
            and self._ranges
            and self._ranges[-1].startswith("FSDP::all_gather")
        ):
            unit = _unit_of(self._ranges[-1])
            self.gathers.append(
                Gather(len(self.samples), unit, phase, _issuer(self._ranges))
            )
        self.samples.append(self._sample(phase, args, kwargs))
        return out

    def _sample(self, phase, args, kwargs) -> Sample:
        whole = buffers = 0
        held, storages = set(), {}
        for unit, groups in self.groups.items():
            for g in groups:
                # gathered, not yet copied out: a prefetch
                if (pending := g._all_gather_result) is not None:
                    buffers += pending.all_gather_output.untyped_storage().nbytes()
                    self._owner[id(pending)] = unit
                    held.add(unit)
                elif g.is_unsharded:
                    held.add(unit)
                    for p in g.fsdp_params:
                        for t in p.all_gather_outputs:
                            storages[t.untyped_storage().data_ptr()] = unit
                            whole += t.untyped_storage().nbytes()
        # a forward all-gather's output, kept for overlap
        if (kept := self.comm_ctx.all_gather_state) is not None:
            buffers += (
                kept.all_gather_result.all_gather_output.untyped_storage().nbytes()
            )
            held.add(self._owner.get(id(kept.all_gather_result), "?"))
        computes = {
            storages[ptr]
            for t in tree_leaves((args, kwargs))
            if type(t) in (torch.Tensor, torch.nn.Parameter)
            and (ptr := t.untyped_storage().data_ptr()) in storages
        }
        # module order; an unknown owner last
        rank = {unit: i for i, unit in enumerate(self.groups)}
        order = lambda units: tuple(sorted(units, key=lambda u: rank.get(u, len(rank))))  # noqa: E731
        return Sample(phase, whole, buffers, order(held), order(computes))


def peak(samples: list[Sample]) -> tuple[int, Sample]:
    """(index, sample) where whole parameters plus buffers were largest; the
    first such."""
    index = max(
        range(len(samples)), key=lambda i: (samples[i].whole + samples[i].buffers, -i)
    )
    return index, samples[index]


def gather_leads(timeline: GatheredTimeline) -> list[dict]:
    """For every all-gather: its unit, phase, issuer, and its lead: the other units that
    computed between the all-gather and the unit's own first computation after it (0:
    issued just in time)."""
    rows = []
    for g in timeline.gathers:
        between: list[str] = []
        for s in timeline.samples[g.index + 1 :]:
            if g.unit in s.computes:
                break
            between += [u for u in s.computes if u not in between]
        rows.append(
            {
                "unit": g.unit,
                "phase": g.phase,
                "issued by": g.issued_by,
                "lead": len(between),
                "during": between,
            }
        )
    return rows
