"""One torchtitan Llama block, run on the CPU, and what it holds for backward.

    shape = BlockShape(dim=256, n_head=4, n_kv_head=2, ffn_hidden=704)
    held = measure_held(shape, "selective-op", torch.bfloat16)
    held.per_token  # bytes per token, block input and parameters left out

The block follows torchtitan's ``torchtitan/models/llama/model.py`` of the published
runs' era (pytorch/torchtitan@6d74b81c): its own RMSNorm class (``norm_type =
"rmsnorm"`` in ``train_configs/llama3_8b.toml`` @0011fb90), rotary embedding as a
complex multiply on ``x.float()``, ``repeat_kv``, causal SDPA, SwiGLU, no biases. The
selective-op policy is torchtitan's (``parallelize_llama.py`` @004b3148): save every
aten.mm output but each second one, and SDPA's outputs.

"Held" is measured, not inferred: a dispatch mode records the storage of every op's
output during the forward, and a weakref finalizer drops it when it is freed; what is
still alive after the forward (the output kept, the graph alive) is what the block
holds. ``distlab.costs.activations`` is the same count on paper.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)


@dataclass(frozen=True)
class BlockShape:
    dim: int  # C, the residual stream's width
    n_head: int  # query heads
    n_kv_head: int  # key/value heads (grouped-query attention)
    ffn_hidden: int  # F, SwiGLU's inner width
    norm_eps: float = 1e-5  # torchtitan's ModelArgs.norm_eps
    rope_theta: float = 500000.0  # Llama 3's; any value holds the same bytes

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim


# --- begin block ---
class RMSNorm(nn.Module):
    """torchtitan's ``RMSNorm`` (``norm_type = "rmsnorm"``): normalise in fp32, cast
    back, scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # a copy in bf16; x itself in fp32
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def precompute_freqs_cis(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # (T, D/2) complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    """Rotate pairs of channels by position, as complex numbers (in fp32)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Each key/value head repeated for the n_rep query heads that share it: the
    reshape of an expanded tensor copies."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x.unsqueeze(3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, s: BlockShape):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = s.n_head, s.n_kv_head, s.head_dim
        self.wq = nn.Linear(s.dim, s.n_head * s.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_dim, bias=False)
        self.wo = nn.Linear(s.n_head * s.head_dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # the order of the mms is what the selective-op policy's parity counts
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, self.n_head, self.head_dim)
        xk = xk.view(bs, seqlen, self.n_kv_head, self.head_dim)
        xv = xv.view(bs, seqlen, self.n_kv_head, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.n_head // self.n_kv_head
        keys, values = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)  # (B, T, H, D)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            is_causal=True,
        )  # (B, H, T, D)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)  # (B, T, C)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, s: BlockShape):
        super().__init__()
        self.attention_norm = RMSNorm(s.dim, s.norm_eps)
        self.attention = Attention(s)
        self.ffn_norm = RMSNorm(s.dim, s.norm_eps)
        self.feed_forward = FeedForward(s.dim, s.ffn_hidden)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


# --- end block ---


# --- begin policy ---
# torchtitan's _save_list (parallelize_llama.py @004b3148) names the CUDA kernels; the
# CPU's flash kernel is added so that the policy means the same here
SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def selective_op_context_fn(save_list=SAVE_LIST, parity: int = 0):
    """A fresh policy per checkpointed forward, as torchtitan builds it: save each op
    of ``save_list`` but every second aten.mm (the one whose count % 2 == parity)."""
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[f"{mode}_mm_count"] += 1
        second_mm = (
            func == torch.ops.aten.mm.default and meta[f"{mode}_mm_count"] % 2 == parity
        )
        if func in save_list and not second_mm:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


AC_MODES = ("none", "selective-op", "full")


def run_block(block, x, freqs_cis, ac: str, parity: int = 0):
    """The block's forward under ``ac``, checkpointed as torchtitan's
    ``checkpoint_wrapper`` does (non-reentrant, no RNG state)."""
    if ac == "none":
        return block(x, freqs_cis)
    if ac not in AC_MODES:
        raise ValueError(f"unknown AC mode {ac!r}; choose one of {', '.join(AC_MODES)}")
    kwargs = {"use_reentrant": False, "preserve_rng_state": False}
    if ac == "selective-op":
        kwargs["context_fn"] = lambda: selective_op_context_fn(parity=parity)
    return checkpoint(block, x, freqs_cis, **kwargs)


# --- end policy ---


# --- begin measure ---
@dataclass
class HeldTensor:
    where: str  # the module running when the op ran
    op: str  # the aten op whose output it is
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    saved_by: list[str] = field(default_factory=list)  # backward nodes (no AC)


class NewStorages(TorchDispatchMode):
    """Every storage an op outputs that was not alive before, while it stays
    alive: a weakref finalizer drops it when it is freed."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known = known  # data_ptrs alive before: inputs, parameters, buffers
        self.live: dict[int, HeldTensor] = {}
        self.where = ["block"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._record(t, func)
        return out

    def _record(self, t: torch.Tensor, func) -> None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if st.nbytes() == 0 or ptr in self.known or ptr in self.live:
            return
        held = HeldTensor(
            self.where[-1],
            func.__name__,
            tuple(t.shape),
            str(t.dtype).removeprefix("torch."),
            st.nbytes(),
        )
        self.live[ptr] = held
        weakref.finalize(st, self._drop, ptr, held)

    def _drop(self, ptr: int, held: HeldTensor) -> None:
        if self.live.get(ptr) is held:
            del self.live[ptr]


def _storage_ptrs(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def held_by(fn, *inputs: torch.Tensor, module: nn.Module | None = None):
    """Run ``fn(*inputs)``; return its output and the storages its forward created
    that are still alive, the output's own left out, keyed by data_ptr."""
    known = _storage_ptrs(inputs)
    if module is not None:
        known |= _storage_ptrs([*module.parameters(), *module.buffers()])
    tracker = NewStorages(known)

    def enter(name: str):
        def hook(mod, args) -> None:
            tracker.where.append(name)

        return hook

    def leave(mod, args, out) -> None:  # returns None: the output stays the module's
        tracker.where.pop()

    hooks = []
    if module is not None:  # name the module each op runs in
        for name, sub in module.named_modules():
            if name:
                hooks.append(sub.register_forward_pre_hook(enter(name)))
                hooks.append(sub.register_forward_hook(leave))
    try:
        with torch.enable_grad(), tracker:
            out = fn(*inputs)
    finally:
        for h in hooks:
            h.remove()
    held = dict(tracker.live)
    held.pop(out.untyped_storage().data_ptr(), None)  # the next block's input
    return out, held


def _saved_by(out: torch.Tensor) -> dict[int, list[str]]:
    """Walk the autograd graph from ``out``: which backward node keeps which
    storage (its ``_saved_*`` attributes)."""
    seen, stack, saved = set(), [out.grad_fn], defaultdict(list)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                value = getattr(node, attr)
                if isinstance(value, torch.Tensor) and value.numel():
                    ptr = value.untyped_storage().data_ptr()
                    saved[ptr].append(f"{node.name()}.{attr[len('_saved_') :]}")
        stack.extend(fn for fn, _ in node.next_functions)
    return saved


@dataclass
class Held:
    ac: str
    dtype: str
    tokens: int
    nbytes: int  # held for backward by the block, input and parameters left out
    tensors: list[HeldTensor]

    @property
    def per_token(self) -> float:
        return self.nbytes / self.tokens


def measure_held(
    shape: BlockShape,
    ac: str,
    dtype: torch.dtype = torch.float32,
    batch: int = 2,
    seq_len: int = 64,
    parity: int = 0,
    seed: int = 0,
    device: str = "cpu",
) -> Held:
    """Bytes one block holds after its forward for its backward, measured. For
    ``ac="none"`` each tensor also names the backward nodes that keep it."""
    torch.manual_seed(seed)
    block = LlamaBlock(shape).to(device, dtype)
    freqs_cis = precompute_freqs_cis(shape.head_dim, seq_len, shape.rope_theta)
    freqs_cis = freqs_cis.to(device)
    # the block input requires grad, as the embedding's output does in a model
    x = torch.randn(
        batch, seq_len, shape.dim, dtype=dtype, device=device, requires_grad=True
    )
    out, held = held_by(
        lambda x, f: run_block(block, x, f, ac, parity), x, freqs_cis, module=block
    )
    if ac == "none":
        for ptr, names in _saved_by(out).items():
            if ptr in held:
                held[ptr].saved_by = sorted(set(names))
    tensors = list(held.values())
    result = Held(
        ac,
        str(dtype).removeprefix("torch."),
        batch * seq_len,
        sum(t.nbytes for t in tensors),
        tensors,
    )
    del out  # frees the graph and what it held
    return result


# --- end measure ---
