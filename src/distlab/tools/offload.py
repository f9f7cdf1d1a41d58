"""Saved-activation offload to host memory, built on ``saved_tensors_hooks``, and a
meter for it.

``torch.autograd.graph.save_on_cpu`` (``torch/autograd/graph.py``) copies every tensor
autograd saves, once per time it is saved: a tensor two operators save is copied twice,
and the weights that matrix products save are copied too. ``HostOffload`` shows the same
mechanism with two changes: it copies each storage once per forward pass, and it leaves
the tensors it is told to keep (the parameters, which are alive anyway) where they are.

``PackMeter`` wraps any pair of pack/unpack hooks and counts what the pack hook was
given and whether it returned a copy: the bytes an offload would move to the host, exact
on any device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef


# --- begin host offload ---
class HostOffload(saved_tensors_hooks):
    """Under this context manager, saved tensors are copied to host memory (pinned when
    CUDA is available, so the copy can be asynchronous) and copied back when backward
    needs them.

    ``keep``: tensors whose storage stays put (pass the model's parameters: they live on
    the device anyway, so copying them only costs bandwidth). ``min_bytes``: storages
    smaller than this stay put too. Each storage is copied once per ``with`` block (one
    forward pass): q, k and v, views of one qkv output, share one copy; a tensor saved
    by two operators is copied once.
    """

    def __init__(self, keep: Iterable[torch.Tensor] = (), min_bytes: int = 0):
        kept = {t.untyped_storage().data_ptr() for t in keep}
        pin = torch.cuda.is_available()
        self._host_copies: dict[int, tuple[StorageWeakRef, torch.UntypedStorage]] = {}
        host_copies = self._host_copies
        self.bytes_moved = 0

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() in kept or storage.nbytes() < min_bytes:
                # stays on its device: autograd keeps it as it would without hooks
                return t
            source, host = host_copies.get(storage.data_ptr(), (None, None))
            # first time, or the address now belongs to a new tensor
            if source is None or source.expired():
                host = torch.empty(
                    storage.nbytes(), dtype=torch.uint8, pin_memory=pin
                ).untyped_storage()
                # device -> host; asynchronous only into pinned memory
                host.copy_(storage, non_blocking=pin)
                host_copies[storage.data_ptr()] = (StorageWeakRef(storage), host)
                self.bytes_moved += storage.nbytes()
            return (t.device, t.dtype, host, t.storage_offset(), t.size(), t.stride())

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, dtype, host, offset, size, stride = packed
            # the saved view, on the host
            view = torch.empty(0, dtype=dtype).set_(host, offset, size, stride)
            return view.to(device, non_blocking=pin)

        super().__init__(pack, unpack)

    def __enter__(self):
        # a storage alive across forwards (the input batch) may have been changed in
        # place since
        self._host_copies.clear()
        return super().__enter__()


# --- end host offload ---


class PackMeter(saved_tensors_hooks):
    """Runs ``pack``/``unpack`` and counts, per forward pass: calls, bytes given to
    ``pack`` (each tensor's own bytes, so a tensor saved twice counts twice), bytes of
    the ``keep`` tensors (parameters) among them, and bytes for which ``pack`` returned
    a new storage (a copy)."""

    def __init__(
        self, pack: Callable, unpack: Callable, keep: Iterable[torch.Tensor] = ()
    ):
        kept = {t.untyped_storage().data_ptr() for t in keep}
        self.calls = self.bytes_packed = self.kept_bytes = self.bytes_copied = 0

        def counted(t: torch.Tensor):
            packed = pack(t)
            nbytes, ptr = t.numel() * t.element_size(), t.untyped_storage().data_ptr()
            self.calls += 1
            self.bytes_packed += nbytes
            self.kept_bytes += nbytes if ptr in kept else 0
            outputs = packed if isinstance(packed, tuple) else (packed,)
            storages = [
                o.untyped_storage().data_ptr()
                for o in outputs
                if isinstance(o, torch.Tensor)
            ]
            storages += [
                o.data_ptr() for o in outputs if isinstance(o, torch.UntypedStorage)
            ]
            if ptr not in storages:
                self.bytes_copied += nbytes
            return packed

        super().__init__(counted, unpack)
