"""Count the bytes of every c10d collective a rank issues, and the bytes its sockets
really wrote.

    with CollectiveBytes() as counted:
        # DDP's C++ Reducer, FSDP2's hooks, ZeRO's broadcasts
        loss.backward()
    # [Call("reduce-scatter", tensor_bytes, group_size, ranks), ...]
    counted.calls
    # what each rank sends on a ring (NCCL's algorithm)
    counted.ring_bytes_sent()

    # /proc/self/io: every byte this process wrote
    written = socket_bytes_written()
    # on gloo, the collectives' real traffic
    ...; socket_bytes_written() - written

Why a ``TorchDispatchMode``: every collective, from Python (FSDP2,
ZeroRedundancyOptimizer) or from C++ (DDP's Reducer), is dispatched as a ``c10d``
operator with its tensors and its process group, so one mode sees them all, with the
size of the group each ran on (HSDP has two). It is thread-local: run the counted code
on the thread that opened it (CPU autograd does).

The tensor bytes are what was handed to the op; the bytes a rank *sends* depend on the
algorithm. ``distlab.costs.collectives.RING_FACTOR`` states the ring's (NCCL's default
for large messages, and gloo's for these ops except reduce-scatter, see
``distlab.chapters.fsdp_communication``): S the tensor bytes, N the group: all-gather
of an output of S sends (N-1)/N S; reduce-scatter of an input of S, (N-1)/N S;
all-reduce of S, 2(N-1)/N S; broadcast of S, (N-1)/N S on average over the ranks (the
root and every rank but the last of the chain send S).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.costs.collectives import ring_bytes_sent

# --- begin ops ---
# c10d operator -> (kind, which argument holds the tensor(s) whose bytes define S,
# group argument)
C10D_OPS = {
    "allreduce_": ("all-reduce", 0, 1),
    # (output, input, group): S is the whole output
    "_allgather_base_": ("all-gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all-gather", 0, 2),
    # (output, input, group): S is the whole input
    "_reduce_scatter_base_": ("reduce-scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
}
# --- end ops ---


@dataclass(frozen=True)
class Call:
    kind: str  # "all-gather", "reduce-scatter", "all-reduce", "broadcast"
    tensor_bytes: int  # S: the bytes of the tensor(s) the op was handed (see C10D_OPS)
    group_size: int  # N: the ranks of the process group it ran on
    # the global ranks of that group, in group order: whom this rank sends to
    ranks: tuple[int, ...] = ()


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _group_ranks(group) -> tuple[int, ...]:
    """The global ranks of a c10d group, or () for a group c10d does not list."""
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (KeyError, ValueError, RuntimeError):
        return ()


class CollectiveBytes(TorchDispatchMode):
    """While open, records a ``Call`` for every c10d collective issued on
    this thread."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []
        # c10d ops not in C10D_OPS (barrier, send, ...): never silently dropped
        self.unknown: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0]
            if name in C10D_OPS:
                kind, tensor_arg, group_arg = C10D_OPS[name]
                group = torch._C._distributed_c10d.ProcessGroup.unbox(args[group_arg])
                size = _nbytes(args[tensor_arg])
                self.calls.append(Call(kind, size, group.size(), _group_ranks(group)))
            else:
                self.unknown.append(name)
        return func(*args, **(kwargs or {}))

    def tensor_bytes(self) -> dict[str, int]:
        """S summed by kind."""
        total: dict[str, int] = defaultdict(int)
        for call in self.calls:
            total[call.kind] += call.tensor_bytes
        return dict(total)

    def counts(self) -> dict[str, int]:
        total: dict[str, int] = defaultdict(int)
        for call in self.calls:
            total[call.kind] += 1
        return dict(total)

    def ring_bytes_sent(self) -> dict[str, float]:
        """Bytes this rank sends, by kind, on a ring (``RING_FACTOR``)."""
        total: dict[str, float] = defaultdict(float)
        for call in self.calls:
            total[call.kind] += ring_bytes_sent(
                call.kind, call.tensor_bytes, call.group_size
            )
        return dict(total)


def socket_bytes_written() -> int:
    """Bytes this process (all its threads) has written so far: ``wchar`` of
    ``/proc/self/io``.

    Linux only. gloo's TCP transport writes every byte it sends through it, so the
    difference over a step, with nothing printed meanwhile, is the step's traffic out of
    this rank."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")
