"""Where the bytes go: model state counted from tensors, activations counted as saved.

Two kinds of memory in training:
* model state (parameters, gradients, optimizer state) lives for the whole run;
* activations, the tensors autograd saves in the forward pass for the backward pass,
  live from a layer's forward to its backward.
Both are counted here from the real tensors, and both have a formula to check against.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook

from distlab.costs.activations import gpt2_block_bytes_per_token
from distlab.model import GPTConfig


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters are DTensors: count only the shard this rank really holds
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state, from
    the tensors."""
    params = list(model.parameters())  # deduplicated: a tied matrix counts once
    out = {
        "params": sum(_bytes(p) for p in params),
        "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _bytes(v)
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
    }
    out["total"] = sum(out.values())
    return out


def adamw_state_bytes_formula(
    n_params: int, n_tensors: int, bytes_per_el: int = 4
) -> dict[str, int]:
    """fp32 AdamW: weights 4N, gradients 4N, two moments 8N (16 bytes per parameter),
    plus AdamW's 4-byte ``step`` counter per parameter tensor."""
    out = {
        "params": bytes_per_el * n_params,
        "grads": bytes_per_el * n_params,
        "optimizer": 2 * 4 * n_params + 4 * n_tensors,
    }
    out["total"] = sum(out.values())
    return out


def saved_activation_bytes(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, autocast=None
) -> int:
    """Bytes autograd keeps from one forward pass for the backward pass.

    Every tensor saved for backward passes through the pack hook; we count each
    underlying storage once (q, k and v are views of one qkv output) and skip the
    parameters, which are model state, not activations.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if autocast is None:
            model(idx, targets)
        else:
            with autocast:
                model(idx, targets)
    return sum(storages.values())


def activation_bytes_formula(
    cfg: GPTConfig, batch: int, seq_len: int, value_bytes: int = 4
) -> dict[str, int]:
    """Saved activations of ``GPT(cfg)``, worked out tensor by tensor, for a model
    computing in fp32 (``value_bytes=4``) or with bf16 parameters (2: FSDP2's
    ``param_dtype=bf16``).

    Per block: ``costs.activations.gpt2_block_bytes_per_token`` (16 BTC values and the
    small terms: each LayerNorm's statistics, attention's log-sum-exp). Outside the
    blocks: the final LayerNorm's input,
    output and statistics (2BTC + 2BT), the log-softmax of the logits (BTV, fp32 in both
    cases: the loss is computed from ``logits.float()``), the int64 token ids, positions
    and targets, and the loss's 4-byte weight sum. (With bf16 inputs the CPU keeps
    LayerNorm's statistics in bf16, as counted here; CUDA keeps them in fp32, 2BT bytes
    more per LayerNorm.)
    """
    if value_bytes not in (2, 4):
        raise ValueError(f"value_bytes is 4 (fp32) or 2 (bf16), got {value_bytes!r}")
    B, T, C, V, H, L = (
        batch,
        seq_len,
        cfg.n_embd,
        cfg.vocab_size,
        cfg.n_head,
        cfg.n_layer,
    )
    w, fp32 = value_bytes, 4
    per_block = B * T * gpt2_block_bytes_per_token(C, 4 * C, H, w)
    head = w * (2 * B * T * C + 2 * B * T) + fp32 * B * T * V
    ids = 8 * (B * T + T + B * T) + fp32
    return {
        "blocks": L * per_block,
        "per_block": per_block,
        "outside_blocks": head + ids,
        "total": L * per_block + head + ids,
    }


def tracker_snapshot(tracker, when: str, device: torch.device) -> dict:
    """``tracker.get_tracker_snapshot(when)`` ("current" or "peak") for one device:
    {kind: bytes}.

    PyTorch's memory trackers (``MemTracker``, ``FSDPMemTracker``) keep a breakdown per
    device. A step on a GPU also makes CPU tensors (AdamW keeps its ``step`` counters on
    the CPU unless it is fused or capturable: ``_init_group`` in
    ``torch/optim/adam.py``), which the tracker files under the CPU; so read the device
    the model lives on, not the snapshot's first.
    """
    snapshot = tracker.get_tracker_snapshot(when)
    device = torch.device(device)
    if device not in snapshot:
        seen = ", ".join(map(str, snapshot)) or "none"
        raise ValueError(
            f"the memory tracker saw no tensors on {device} (devices it saw: {seen})"
        )
    return snapshot[device]


def device_memory_peaks(device: torch.device | str) -> dict[str, int]:
    """This process's peak GPU memory on ``device`` since it started (or since
    ``torch.cuda.reset_peak_memory_stats``), in bytes; ``{}`` off CUDA.

    ``cuda_max_memory_allocated``: the most bytes that tensors occupied at once.
    ``cuda_max_memory_reserved``: the most bytes PyTorch's caching allocator held from
    the CUDA driver at once, which is never less. The allocator keeps the blocks that
    freed tensors leave, to reuse them without asking the driver again, and carves
    tensors out of larger segments, so gaps between them stay reserved. Reserved is what
    ``nvidia-smi`` roughly sees of PyTorch; it shows more, since it also counts the CUDA
    context and what libraries allocate past the allocator (PyTorch's CUDA notes,
    "Memory management"; ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``
    in ``torch/cuda/memory.py``).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {
        "cuda_max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "cuda_max_memory_reserved": torch.cuda.max_memory_reserved(device),
    }


def activation_peak_bytes(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor
) -> dict[str, int]:
    """Activations of one forward and backward, measured by PyTorch's ``MemTracker``:
    ``saved``, the bytes it counts as activations when forward ends, and ``peak``, the
    most bytes of activations and backward temporaries alive at once, sampled after
    every operator. The tracker's own peak snapshot is taken when *all* memory peaks,
    gradients included; this is the peak of the activations themselves. The logits are
    dropped at once (``model(x, y)[1]``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def activations(snapshot: dict) -> int:
        return sum(
            n
            for kind, n in snapshot.items()
            if str(kind).rsplit(".", 1)[-1] in ("ACT", "TEMP")
        )

    # only its bytes: a GPU step makes a few CPU tensors too
    device = next(model.parameters()).device

    class SampledTracker(MemTracker):  # private API of torch 2.13, as StepMemory's
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.most = max(self.most, activations(self._curr_mem_snap.get(device, {})))
            return out

    tracker = SampledTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(idx, targets)[1]
        after_forward = tracker_snapshot(tracker, "current", device)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return {"saved": activations(after_forward), "peak": tracker.most}


def memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer):
    """PyTorch's memory tracker for ``model`` and its optimizer, to enter around what
    it measures: ``FSDPMemTracker`` for an FSDP2 model (it tells shards from gathered
    parameters), else ``MemTracker`` (private APIs of torch 2.13, on CPU and GPU)."""
    from torch.distributed.fsdp import FSDPModule

    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        # Accelerate's wrapper: the trackers hook the real one
        optimizer = optimizer.optimizer

    if isinstance(model, FSDPModule):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


# the tracker's categories, by the names the labs' summaries use
_KINDS = {
    "PARAM": "params",
    "BUFFER": "buffers",
    "GRAD": "grads",
    "ACT": "activations",
    "TEMP": "temporaries",
    "OPT": "optimizer",
    "OTH": "other",
    "Total": "total",
    # FSDPMemTracker's own: a rank's shards, the whole tensors it gathers for a while,
    # and the buffers of the collectives themselves
    "SHARDED_PARAM": "sharded_params",
    "UNSHARDED_PARAM": "unsharded_params",
    "SHARDED_GRAD": "sharded_grads",
    "UNSHARDED_GRAD": "unsharded_grads",
    "ALL_GATHER": "all_gather",
    "REDUCE_SCATTER": "reduce_scatter",
    "INP": "inputs",
}


class StepMemory:
    """Peak bytes by kind during one training step of a lab, from PyTorch's
    memory tracker.

        memory = StepMemory(model, optimizer, enabled=cfg.track_memory)
        for step in ...:
            memory.begin()
            ...  # the train step
            memory.end()
        memory.peak  # {"params": ..., "grads": ..., "optimizer": ...,
                     #  "activations": ..., "total": ...}

    ``MemTracker`` (``FSDPMemTracker`` for an FSDP2 model) attributes every tensor this
    rank allocates to parameters, gradients, optimizer state, activations or
    temporaries, on CPU and GPU alike (private APIs of torch 2.13). It slows the step it
    watches, so this watches the second step a run makes, which the labs leave out of
    their timing; the first would miss AdamW's state, which is created lazily. ``peak``
    is the moment this rank held the most bytes on the model's device, split by kind
    (the kinds add up to ``total``); the caching allocator's own peaks over the whole
    run are ``device_memory_peaks``. Disabled, it does nothing.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, enabled: bool = True
    ):
        self.model, self.optimizer, self.enabled = model, optimizer, enabled
        self.peak: dict[str, int] = {}
        self._steps_seen = 0
        self._tracker = None

    def begin(self) -> None:
        self._steps_seen += 1
        if self.enabled and self._steps_seen == 2:
            self._tracker = memory_tracker(self.model, self.optimizer)
            # the tracker refuses a second forward of the whole model within its context
            # (it takes it for the next iteration), but with gradient accumulation a
            # step has one per micro-batch: forget the per-module statistics (we do not
            # read them) before each. A global hook registered first runs before the
            # tracker's own.
            self._reset_hook = register_module_forward_pre_hook(self._before_forward)
            self._tracker.__enter__()

    def _before_forward(self, module: nn.Module, args) -> None:
        if module is self.model and module in self._tracker.memory_tracking:
            self._tracker.reset_mod_stats()

    def end(self) -> None:
        if self._tracker is None:
            return
        self._tracker.__exit__(None, None, None)
        self._reset_hook.remove()
        by_kind = tracker_snapshot(
            self._tracker, "peak", next(self.model.parameters()).device
        )
        self._tracker = None
        self.peak = {
            _KINDS.get(str(kind).rsplit(".", 1)[-1], str(kind)): int(n)
            for kind, n in by_kind.items()
        }
