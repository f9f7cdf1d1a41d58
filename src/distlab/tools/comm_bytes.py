"""Count the bytes a rank hands to ``torch.distributed.all_reduce``, from any thread.

    with CountedAllReduce() as counted:
        loss.backward()  # DDP runs its comm hook, which calls dist.all_reduce
    counted.calls        # [(numel, dtype, bytes), ...] in call order

Why patch the Python function and not a ``TorchDispatchMode`` (``CommDebugMode``): a
dispatch mode is thread-local, and on gloo the follow-up all-reduces of a chained hook
(PowerSGD's P and Q) are issued by ``Future.then`` callbacks on gloo's own threads,
which a mode on the main thread never sees. Every comm hook of
``torch/distributed/algorithms/ddp_comm_hooks/`` calls ``dist.all_reduce`` by module
attribute, so the patch sees them all; DDP's default path (no hook) calls the process
group from C++ and is not seen: count it through ``allreduce_hook``, which does the same
(its docstring says so).
"""

import threading

import torch
import torch.distributed as dist


class CountedAllReduce:
    """A context manager: while it is open, every ``dist.all_reduce`` call
    is recorded."""

    def __init__(self):
        self.calls: list[tuple[int, torch.dtype, int]] = []
        self._lock = threading.Lock()
        self._real = None

    def __enter__(self) -> "CountedAllReduce":
        self._real = real = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            with self._lock:
                self.calls.append(
                    (
                        tensor.numel(),
                        tensor.dtype,
                        tensor.numel() * tensor.element_size(),
                    )
                )
            return real(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._real

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.calls)

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()
