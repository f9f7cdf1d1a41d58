"""Predict a training run's memory per GPU and its step time before it runs: the
book's capstone.

    cluster = gpu_cluster("a100-80gb", gpus=64, gpus_per_node=8, network="ib-200g")
    plan = Plan("fsdp2", micro_batch=1, seq_len=8192, ac="full")
    p = predict(shape("llama3-70b"), cluster, plan)
    p["memory"]["total"], p["time"]["step"], p["tokens_per_s_per_gpu"], p["mfu"]

Every term is one the book derives (each chapter's page is named beside it):
* memory: model state as the ZeRO paper counts it (``costs.state.per_rank_bytes``,
  book/zero_memory.md); the whole units FSDP2 gathers (book/fsdp2.md); activations
  saved per token (``costs.activations`` for a torchtitan Llama block, measured on the
  CPU by ``planner.llama_block``, and for the book's GPT-2 block,
  book/activation_checkpointing.md) and the peak at the loss (book/single_device.md);
* compute: FLOPs per token (``distlab.flops``, book/single_device.md) at the fraction of
  the peak a GEMM reaches (``efficiency``: calibrated on published runs by
  ``planner.calibrate``, else a public microbenchmark's, or this machine's measured
  matmul), plus the bytes the non-matmul ops move at the memory bandwidth (a roofline:
  those ops do too few FLOPs per byte);
* communication: the ring of ``costs.collectives`` (book/collectives.md), across nodes
  at NCCL's bus bandwidth, a channel per NIC, for each collective a strategy's row
  (``costs.strategies``) issues (book/ddp_internals.md, book/fsdp_communication.md),
  hidden behind compute as the buckets and the prefetched units allow
  (``planner.comm.fsdp_timeline``, book/ddp_overlap.md,
  book/fsdp_prefetch_offload.md).
What is fitted, and on which runs, lives apart: ``planner.calibrate`` (book/planner.md
shows every run predicted with itself left out).
"""

from __future__ import annotations

import dataclasses

from distlab.costs.activations import (
    gpt2_block_bytes_per_token,
    held_bytes_per_token,
    sac_recompute_matmul_fraction,
)
from distlab.costs.state import bytes_per_param, per_rank_bytes
from distlab.costs.strategies import STRATEGIES as STRATEGY_ROWS
from distlab.planner.comm import PRECISIONS, communication
from distlab.planner.inputs import (  # noqa: F401 (the planner's API, in one import)
    AC_MODES,
    ATTENTION_BACKWARD,
    FIT_FRACTION,
    OPTIMIZER,
    OPTIMIZER_BYTES_PER_PARAM,
    STATES,
    STRATEGIES,
    Cluster,
    Device,
    Plan,
    check,
    gpu_cluster,
)
from distlab.planner.shapes import ModelShape


# --- begin memory ---
def memory(shape: ModelShape, cluster: Cluster, plan: Plan) -> dict[str, float]:
    """Bytes per rank at the peak of a step, by part, and ``state``: the model state
    held all along.

    The peak is at the loss (or in the last block's backward), before this step's
    backward has made a gradient: the loop's ``zero_grad()`` left none. What gradients
    exist then: DDP's buckets, a copy of every gradient allocated once
    (``gradient_as_bucket_view=False``, the default), and, while micro- batches
    accumulate, the ones accumulated so far: beside DDP's buckets; unsharded under FSDP2
    when it reduces only on the last micro-batch (``grad buffers``), sharded when it
    reduces every one."""
    w, n = PRECISIONS[plan.precision], cluster.gpus
    state = per_rank_bytes(
        shape.n_params(),
        n,
        plan.state,
        OPTIMIZER,
        plan.strategy,
        plan.group if STRATEGY_ROWS[plan.strategy].shards_over == "group" else None,
    )
    g = bytes_per_param(plan.state)["grads"]
    accumulating = plan.accum > 1
    out = {
        "params": state["params"],
        "grads": state["grads"],
        "optimizer": state["optimizer"],
    }
    sharded = STRATEGY_ROWS[plan.strategy].gathered is not None
    if sharded:
        out["grads"] = (
            state["grads"] if accumulating and plan.sync_every_micro_batch else 0.0
        )
    elif accumulating:
        # the accumulated .grad, beside the buckets
        out["grads"] += g * shape.n_params()
    # FSDP2 holds the root and two whole blocks (the one computing, the one prefetched)
    # in the compute dtype
    gathered = STRATEGY_ROWS[plan.strategy].gathered
    out["gathered"] = (
        w
        * {
            None: 0.0,
            "units": shape.root_params() + 2 * shape.block_params(),
            "model": shape.n_params(),
        }[gathered]
    )
    whole = sharded and accumulating and not plan.sync_every_micro_batch
    out["grad buffers"] = g * shape.n_params() if whole else 0.0
    out["activations"] = activation_terms(
        shape, plan.micro_batch, plan.seq_len, plan.ac, plan.ac_every, w
    )["peak"]
    out["total"] = sum(out.values())
    out["state"] = state["total"]
    out["capacity"] = cluster.device.memory_bytes
    out["fits"] = out["total"] <= FIT_FRACTION * cluster.device.memory_bytes
    return out


def block_bytes_per_token(shape: ModelShape, ac: str, w: int) -> float:
    """Bytes one block keeps for backward per token, its input included
    (``distlab.costs.activations``): a Llama block as torchtitan runs it (measured on
    the CPU by ``distlab.planner.llama_block``); the book's GPT-2 block as
    ``distlab.memory`` counts it (selective-op: about half of it, no policy of its
    own)."""
    C, F, H = shape.d_model, shape.ffn_hidden, shape.n_head
    if not shape.gpt2:
        dtype = {4: "fp32", 2: "bf16"}[w]
        return w * C + held_bytes_per_token(C, shape.kv_dim, F, H, ac, dtype)["total"]
    block = gpt2_block_bytes_per_token(C, F, H, w)
    return block // 2 if ac == "selective-op" else block


def activation_terms(
    shape: ModelShape, batch: int, seq_len: int, ac: str, every: int, w: int
) -> dict:
    """The activations of one micro-batch: ``saved`` after the forward (every block's
    kept tensors, or a checkpointed block's input, and what the layers outside the
    blocks keep), ``recompute`` (one checkpointed block's tensors, rebuilt in
    backward), and ``peak``: saved plus the most backward adds at one moment, ``at``
    one of two:
    * "loss": log-softmax's backward holds the gradients of its output and of the
      logits, two (B, T, V) fp32 tensors (fp32 in bf16 too: the loss is computed from
      logits.float());
    * "last block": the recomputed block, if any, and the MLP's backward: the gradients
      of the block's output (BTC) and of the hidden layer (BTF), the down-projection's
      weight and bias gradients (CF + C) and the head's weight gradient (VC); by then
      the log-softmax output (BTV, fp32) and the final norm's tensors are freed."""
    B, T, C, F, V, L = (
        batch,
        seq_len,
        shape.d_model,
        shape.ffn_hidden,
        shape.vocab_size,
        shape.n_layer,
    )
    block = B * T * block_bytes_per_token(shape, "none", w)
    checkpointed = {
        "none": 0,
        "full": L,
        "selective-layer": L // every,
        "selective-op": 0,
    }[ac]
    saved = (L - checkpointed) * block + checkpointed * w * B * T * C
    recompute = block if checkpointed else 0
    if ac == "selective-op":
        # what the policy keeps of every block, and what backward recomputes of one
        kept = B * T * block_bytes_per_token(shape, "selective-op", w)
        saved, recompute = L * kept, block - kept
    # the final norm's input and output, its statistics, the fp32 log-softmax, the
    # int64 token ids, positions and targets, and the loss's 4-byte weight sum
    stats = 2 * w if shape.gpt2 else 4
    outside = (
        w * 2 * B * T * C + B * T * stats + 4 * B * T * V + 8 * (2 * B * T + T) + 4
    )
    freed = 4 * B * T * V + w * 2 * B * T * C + B * T * stats
    added = {
        "loss": 2 * 4 * B * T * V,
        "last block": recompute + w * (B * T * (C + F) + C * F + C + V * C) - freed,
    }
    at = max(added, key=added.get)
    return {
        "saved": saved + outside,
        "recompute": recompute,
        "peak": saved + outside + added[at],
        "at": at,
        "added": added,
    }


# --- end memory ---


# --- begin compute ---
def block_seconds(shape: ModelShape, device: Device, plan: Plan) -> dict[str, float]:
    """One block's forward and backward on one rank for one micro-batch, and the head's
    (its matmul and the loss). Matmuls at ``matmul_efficiency`` of the peak; attention's
    two matmuls at ``attention_efficiency`` (a causal kernel does half of the 12*L*C*T
    the FLOP count reports, and its backward 2.5 times its forward: FlashAttention's
    convention, the one its efficiency is stated in); the non-matmul ops' bytes at the
    memory bandwidth. The matmuls' backward: twice their forward's FLOPs."""
    w, T, tokens = (
        PRECISIONS[plan.precision],
        plan.seq_len,
        plan.micro_batch * plan.seq_len,
    )
    mm = lambda flops: flops / (device.peak_flops * device.matmul_efficiency)  # noqa: E731
    # forward, causal
    attn = (
        2
        * shape.d_model
        * T
        * tokens
        / (device.peak_flops * device.attention_efficiency)
    )
    values = shape.elementwise_values_per_token()
    fwd_mm, fwd_mem = (
        mm(2 * shape.block_matmul_params() * tokens),
        w * values["forward"] * tokens / device.mem_bandwidth,
    )
    head_mm = mm(2 * shape.vocab_size * shape.d_model * tokens)
    loss = shape.loss_bytes_per_token(w) * tokens / device.mem_bandwidth
    # what backward recomputes per block, averaged over the blocks: all of a
    # checkpointed block's forward; with selective-op (torchtitan's policy), the
    # non-matmul ops and the matmuls its parity rule drops (wk, wo, w3 of a Llama
    # block: 36.5% of the matmul FLOPs of Llama 3 8B); a GPT-2 block has no such
    # policy here: half
    C, kv, F = shape.d_model, shape.kv_dim, shape.ffn_hidden
    redone = 0.5 if shape.gpt2 else sac_recompute_matmul_fraction(C, kv, F)
    recompute = {
        "none": 0.0,
        "full": fwd_mm + attn + fwd_mem,
        "selective-layer": (fwd_mm + attn + fwd_mem)
        * (shape.n_layer // plan.ac_every)
        / shape.n_layer,
        "selective-op": redone * fwd_mm + fwd_mem,
    }[plan.ac]
    return {
        "forward": fwd_mm + attn + fwd_mem,
        "backward": 2 * fwd_mm
        + ATTENTION_BACKWARD * attn
        + w * values["backward"] * tokens / device.mem_bandwidth
        + recompute,
        "recompute": recompute,
        "head forward": head_mm + loss / 2,
        "head backward": 2 * head_mm + loss / 2,
        "matmul": 3 * shape.n_layer * fwd_mm + 3 * head_mm,
        "attention": (1 + ATTENTION_BACKWARD) * shape.n_layer * attn,
        "memory-bound": shape.n_layer
        * w
        * sum(values.values())
        * tokens
        / device.mem_bandwidth
        + loss,
    }


# --- end compute ---


# --- begin predict ---
def predict(
    shape: ModelShape, cluster: Cluster, plan: Plan, efficiency: float | None = None
) -> dict:
    """Memory per rank and the time of one optimizer step: the compute of every
    micro-batch, the communication the compute does not hide, and the optimizer's update
    of this rank's parameters."""
    check(shape, cluster, plan)
    if (
        efficiency is not None
    ):  # a calibrated GEMM efficiency (distlab.planner.calibrate)
        device = dataclasses.replace(cluster.device, matmul_efficiency=efficiency)
        cluster = dataclasses.replace(cluster, device=device)
    blocks = block_seconds(shape, cluster.device, plan)
    L, tokens = shape.n_layer, plan.micro_batch * plan.seq_len * plan.accum
    per_micro_batch = (
        L * (blocks["forward"] + blocks["backward"])
        + blocks["head forward"]
        + blocks["head backward"]
    )
    comm = communication(shape, cluster, plan, blocks)
    # ranks that share the update
    row = STRATEGY_ROWS[plan.strategy]
    owners = 1 if "optimizer" not in row.sharded else cluster.gpus
    owners = plan.group if row.shards_over == "group" else owners
    optimizer = (
        OPTIMIZER_BYTES_PER_PARAM
        * shape.n_params()
        / owners
        / cluster.device.mem_bandwidth
    )
    compute = plan.accum * per_micro_batch
    step = compute + comm["exposed"] + optimizer
    parts = {
        k: plan.accum * blocks[k] * (L if k == "recompute" else 1)
        for k in ("matmul", "attention", "memory-bound")
    }
    parts["recompute"] = plan.accum * L * blocks["recompute"]
    tokens_per_s = tokens / step
    return {
        "memory": memory(shape, cluster, plan),
        "time": {
            "compute": compute,
            **parts,
            "collectives": comm["collectives"],
            "communication": sum(comm["collectives"].values()),
            "exposed": comm["exposed"],
            "optimizer": optimizer,
            "step": step,
        },
        "tokens_per_s_per_gpu": tokens_per_s,
        "mfu": tokens_per_s
        * shape.flops_per_token(plan.seq_len)
        / cluster.device.peak_flops,
    }


# --- end predict ---
