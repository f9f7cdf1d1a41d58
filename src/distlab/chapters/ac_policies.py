"""Activation checkpointing past the defaults: a counting policy, offload to the host,
the compiler's memory budget; bytes kept and work recomputed, measured.

* ``every_other_matmul_context``: torchtitan's op-level selective policy (save every
  other matrix product and every attention output), written for this book's model;
* ``BackwardWork``: a dispatch mode that counts the operators run during backward and
  the FLOPs of the matrix products and attention kernels among them: what a policy
  makes the backward pass recompute;
* ``policy_costs``: bytes kept (``MemTracker``), work recomputed and gradients, per
  policy;
* ``offload_traffic``: what ``save_on_cpu`` and ``tools.offload.HostOffload`` pack and
  copy;
* ``budget_sweep``: ``torch._functorch.config.activation_memory_budget`` on one compiled
  block;
* ``checkpoint_offload_packs``: what ``offload_wrapper(checkpoint_wrapper(block))``
  moves to the host.
"""

from __future__ import annotations

import collections

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from distlab.chapters.activation_checkpointing import activation_memory, build
from distlab.model import GPT, preset
from distlab.parallel import SAVE_MATMULS_AND_ATTENTION, save_ops_policy
from distlab.tools.offload import HostOffload, PackMeter

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})
# the attention kernels this torch has
ATTENTION = frozenset(SAVE_MATMULS_AND_ATTENTION) - MATMULS


# --- begin every other matmul ---
def every_other_matmul_context():
    """``context_fn`` for ``checkpoint_wrapper``: keep every attention output and the
    1st, 3rd, ... matrix product of each checkpointed call; recompute everything else.

    The count must start again at each call, so the counter is made here, in the
    ``context_fn`` that checkpoint calls once per forward of a wrapped block (as
    torchtitan does). A policy built once and shared would carry the count from block to
    block. The count is kept per ``ctx.is_recompute``: torch 2.13 asks the policy only
    during forward, earlier releases asked again during recomputation and needed the
    same answers.
    """
    matmuls_seen = collections.Counter()

    def policy(ctx, op, *args, **kwargs):
        if op in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMULS:
            matmuls_seen[ctx.is_recompute] += 1
            if matmuls_seen[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# --- end every other matmul ---


def offload_matmuls_policy(ctx, op, *args, **kwargs):
    """Marks matmul and attention outputs ``MUST_CPU_OFFLOAD``: documented as "saved,
    offloaded to CPU", but torch 2.13's eager caching mode stores only
    ``MUST_SAVE``/``PREFER_SAVE`` outputs (``_CachingTorchDispatchMode``), so these are
    recomputed like any other."""
    if op in MATMULS or op in ATTENTION:
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = (
    "none",
    "full",
    "save all matmuls",
    "every other matmul",
    "offload matmuls (MUST_CPU_OFFLOAD)",
)


def checkpointed(preset_name: str, policy: str, seed: int = 0) -> GPT:
    """A GPT of ``preset_name`` whose blocks are checkpointed under ``policy`` (one of
    ``POLICIES``)."""
    if policy not in POLICIES:
        raise ValueError(
            f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}"
        )
    if policy in ("none", "full"):
        return build(preset_name, policy, seed=seed)
    if policy == "save all matmuls":
        return build(preset_name, "selective", policy=save_ops_policy(), seed=seed)
    if policy.startswith("offload matmuls"):
        return build(preset_name, "selective", policy=offload_matmuls_policy, seed=seed)
    model = build(preset_name, seed=seed)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(
            block, context_fn=every_other_matmul_context
        )
    return model


def forward_flops(op, args) -> int:
    """FLOPs of one matrix product or one attention forward kernel (2 per multiply-add;
    attention as two (T x hs) by (hs x T) products per head, the causal mask ignored, as
    PyTorch's ``flop_counter.sdpa_flop`` counts it); 0 for any other operator."""
    if op in (aten.mm.default, aten.addmm.default):
        a, b = (args[0], args[1]) if op == aten.mm.default else (args[1], args[2])
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if op == aten.bmm.default:
        a, b = args[0], args[1]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if op in ATTENTION:
        (batch, heads, t_query, head_size), t_key = args[0].shape, args[1].shape[-2]
        return 4 * batch * heads * t_query * t_key * head_size
    return 0


class BackwardWork(TorchDispatchMode):
    """Counts every aten operator it sees, and the FLOPs of the matrix products and
    attention forward kernels among them (``forward_flops``; backward kernels other than
    ``mm`` add 0).

    Entered around ``loss.backward()`` it sees the backward kernels and any forward
    operators that checkpointing reruns; selective checkpointing's cached outputs are
    returned by its own dispatch mode, above this one, so they are never counted.
    (PyTorch's ``FlopCounterMode`` would do for the FLOPs, but it has no formula for the
    CPU attention kernel, ``_scaled_dot_product_flash_attention_for_cpu``:
    ``torch/utils/flop_counter.py``.)
    """

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func).removeprefix("aten.").removesuffix(".default")] += 1
        self.flops += forward_flops(func, args)
        return func(*args, **(kwargs or {}))


def _work(
    model: nn.Module, idx, targets
) -> tuple[BackwardWork, BackwardWork, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with BackwardWork() as forward:
        loss = model(idx, targets)[1]
    with BackwardWork() as backward:
        loss.backward()
    return forward, backward, [p.grad.clone() for p in model.parameters()]


def _recomputed(backward: BackwardWork, baseline: BackwardWork) -> dict[str, int]:
    """Operators run more often in this backward than in the baseline's: the
    recomputation."""
    return {
        op: n - baseline.ops[op]
        for op, n in backward.ops.items()
        if n > baseline.ops[op]
    }


def policy_costs(
    preset_name: str = "tiny", batch: int = 8, seed: int = 0
) -> list[dict]:
    """Per policy: bytes kept after forward and the peak (``MemTracker``), matmul FLOPs
    and operators recomputed in backward (against no checkpointing), and the largest
    gradient difference from no checkpointing."""
    cfg = preset(preset_name)
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(
        0, cfg.vocab_size, (2, batch, cfg.block_size), generator=gen
    )
    forward, baseline, reference = _work(build(preset_name), idx, targets)
    rows = []
    for policy in POLICIES:
        model = checkpointed(preset_name, policy)
        memory = activation_memory(model, idx, targets)
        _, backward, grads = _work(model, idx, targets)
        recomputed = _recomputed(backward, baseline)
        rows.append(
            {
                "policy": policy,
                "kept": memory["saved"],
                "peak": memory["peak"],
                "recomputed_flops": backward.flops - baseline.flops,
                "forward_flops": forward.flops,
                "recomputed_ops": recomputed,
                "grad_max_abs_diff": max(
                    (g - r).abs().max().item() for g, r in zip(grads, reference)
                ),
            }
        )
    return rows


def offload_traffic(
    preset_name: str = "tiny", batch: int = 8, seed: int = 0
) -> tuple[list[dict], int]:
    """One forward and backward under ``save_on_cpu`` (pinned and not) and under
    ``HostOffload``: pack calls, bytes packed and copied, parameter bytes among them,
    and the gradient difference from no hooks; and the bytes of the distinct activation
    storages saved (one copy of each). On this CPU the "host" is the same memory: the
    bytes are what a GPU would move."""
    from torch.autograd.graph import save_on_cpu

    from distlab.memory import saved_activation_bytes

    cfg = preset(preset_name)
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(
        0, cfg.vocab_size, (2, batch, cfg.block_size), generator=gen
    )
    _, _, reference = _work(build(preset_name), idx, targets)
    distinct = saved_activation_bytes(build(preset_name), idx, targets)
    rows = []
    for name in (
        "save_on_cpu()",
        "save_on_cpu(pin_memory=True)",
        "HostOffload(keep=parameters)",
    ):
        model = build(preset_name)
        params = list(model.parameters())
        if name.startswith("HostOffload"):
            hooks = HostOffload(keep=params)
        else:
            hooks = save_on_cpu(pin_memory="pin_memory" in name)
        meter = PackMeter(hooks.pack_hook, hooks.unpack_hook, keep=params)
        model.zero_grad(set_to_none=True)
        with meter:
            loss = model(idx, targets)[1]
        loss.backward()
        copied = (
            hooks.bytes_moved if isinstance(hooks, HostOffload) else meter.bytes_copied
        )
        diff = max((p.grad - r).abs().max().item() for p, r in zip(params, reference))
        rows.append(
            {
                "hooks": name,
                "pack_calls": meter.calls,
                "bytes_packed": meter.bytes_packed,
                "parameter_bytes": meter.kept_bytes,
                "bytes_copied": copied,
                "grad_max_abs_diff": diff,
            }
        )
    return rows, distinct


def budget_sweep(
    budgets=(1.0, 0.5, 0.1, 0.0),
    preset_name: str = "tiny",
    batch: int = 8,
    backend: str = "aot_eager",
):
    """One block compiled at each ``activation_memory_budget``: bytes the compiled
    forward saves for backward (parameters left out), matmul FLOPs and attention calls
    the compiled backward recomputes (against the eager block without checkpointing),
    and the gradient difference.

    The budget is read by the min-cut partitioner when the block is compiled
    (``torch.compile`` compiles at the first call), so each budget gets a fresh compile
    under ``config.patch``. ``knapsack_budgets``: the budgets the partitioner solved a
    knapsack for while compiling (``_optimize_runtime_with_given_memory``, private; none
    when a cheaper min-cut fit).
    """
    from unittest import mock

    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._functorch.partitioners as partitioners

    cfg = preset(preset_name)
    x0 = torch.randn(
        batch, cfg.block_size, cfg.n_embd, generator=torch.Generator().manual_seed(0)
    )

    def run(block_fn, block):
        x = x0.clone().requires_grad_()
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block_fn(x)
        with BackwardWork() as backward:
            y.pow(2).sum().backward()
        return (
            sum(saved.values()),
            len(saved),
            backward,
            [p.grad.clone() for p in [x, *block.parameters()]],
        )

    eager = GPT(cfg).blocks[0]
    eager_bytes, eager_count, baseline, reference = run(eager, eager)
    rows = [
        {
            "budget": "eager, no checkpointing",
            "saved": eager_bytes,
            "saved_storages": eager_count,
            "recomputed_flops": 0,
            "recomputed_ops": {},
            "grad_max_abs_diff": 0.0,
        }
    ]
    for budget in budgets:
        # the budget is applied at compile time: recompile for each
        torch._dynamo.reset()
        block = GPT(cfg).blocks[0]
        knapsack = mock.patch.object(
            partitioners,
            "_optimize_runtime_with_given_memory",
            wraps=partitioners._optimize_runtime_with_given_memory,
        )
        with (
            functorch_config.patch(activation_memory_budget=budget),
            knapsack as solved,
        ):
            compiled = torch.compile(block, backend=backend)
            # first call compiles; its numbers include no recompilation
            run(compiled, block)
            block.zero_grad(set_to_none=True)
            saved, count, backward, grads = run(compiled, block)
        rows.append(
            {
                "budget": budget,
                "saved": saved,
                "saved_storages": count,
                "recomputed_flops": backward.flops - baseline.flops,
                "recomputed_ops": _recomputed(backward, baseline),
                "grad_max_abs_diff": max(
                    (g - r).abs().max().item() for g, r in zip(grads, reference)
                ),
                "knapsack_budgets": sorted(
                    {call.args[3] for call in solved.call_args_list}
                ),
            }
        )
    torch._dynamo.reset()
    return rows


def checkpoint_offload_packs(preset_name: str = "tiny", batch: int = 8) -> list:
    """Shapes of the tensors that ``offload_wrapper(checkpoint_wrapper(block))`` moves
    to the host in one forward pass: its ``save_on_cpu(pin_memory=True)`` sees only what
    the checkpointed block saves, the block's input (the checkpoint's own hooks take
    every tensor saved inside the block)."""
    from unittest import mock

    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as cw

    cfg = preset(preset_name)
    model = build(preset_name)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = cw.offload_wrapper(cw.checkpoint_wrapper(block))
    shapes = []

    class Counted(cw.save_on_cpu):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            inner = self.pack_hook

            def pack(t):
                shapes.append(tuple(t.shape))
                return inner(t)

            self.pack_hook = pack

    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    with mock.patch.object(cw, "save_on_cpu", Counted):
        model(idx, idx)[1].backward()
    return shapes
