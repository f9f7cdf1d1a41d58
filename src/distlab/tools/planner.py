"""Predict a training run's memory per GPU and its step time before it runs: the
book's capstone.

    cluster = gpu_cluster("a100-80gb", gpus=64, gpus_per_node=8, network="ib-200g")
    plan = Plan("fsdp2", micro_batch=1, seq_len=8192, ac="full")
    p = predict(shape("llama3-70b"), cluster, plan)
    p["memory"]["total"], p["time"]["step"], p["tokens_per_s_per_gpu"], p["mfu"]

Every term is one the book derives (each chapter's page is named beside it):
* memory: model state as the ZeRO paper counts it (``memory_calculator.per_rank_bytes``,
  book/zero_memory.md); the whole units FSDP2 gathers (book/fsdp2.md); activations saved
  per token (``ModelShape.saved_values_per_token``, book/activation_checkpointing.md)
  and the peak at the loss (book/single_device.md);
* compute: FLOPs per token (``distlab.flops``, book/single_device.md) at the fraction of
  the peak a GEMM reaches (a public microbenchmark's, or this machine's measured
  matmul), plus the bytes the non-matmul ops move at the memory bandwidth (a roofline:
  those ops do too few FLOPs per byte);
* communication: the alpha-beta ring (book/collectives.md) for each collective a
  strategy issues (book/ddp_internals.md, book/fsdp_communication.md), hidden behind
  compute as the buckets and the prefetched units allow (book/ddp_overlap.md,
  book/fsdp_prefetch_offload.md).
Nothing here is fitted to the runs it is checked against (book/planner.md checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.tools.hardware import GPUS, NETWORKS, NVLINK_LAT
from distlab.tools.memory_calculator import bytes_per_param, per_rank_bytes
from distlab.tools.planner_comm import PRECISIONS, communication
from distlab.tools.shapes import ModelShape
from distlab.tools.step_model import Link

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp2", "hsdp")
AC_MODES = ("none", "full", "selective-op", "selective-layer")
# each strategy's row of the memory calculator
# (distlab.tools.memory_calculator.STRATEGIES), and its optimizer
ZERO_STAGE = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "fsdp2": "zero3",
    "hsdp": "hybrid",
}
OPTIMIZER = "adamw"
STATES = ("fp32", "bf16_mixed")  # how the model state is kept: see Plan.state
# a stated policy, not a measurement: a plan fits if it needs at most 90% of memory
FIT_FRACTION = 0.9
# AdamW's foreach update (torch/optim/adam.py, _multi_tensor_adam), in bytes per fp32
# parameter: decay p *= 1 - lr*wd (8), m.lerp_(g) (12), v *= beta2 (8), v.addcmul_(g, g)
# (16), d = sqrt(v) (8), d /= bc2 (8), d += eps (8), p.addcdiv_(m, d) (16); then
# clip_grad_norm_ reads the gradients for the norm (4) and scales them (8)
OPTIMIZER_BYTES_PER_PARAM = 84 + 12


@dataclass(frozen=True)
class Device:
    """One rank's compute: the peak of the compute dtype, the fraction of it a large
    GEMM and the attention kernel reach, and the memory it holds and streams."""

    name: str
    peak_flops: float
    memory_bytes: float
    mem_bandwidth: float  # bytes/s the memory-bound ops stream at
    matmul_efficiency: float
    attention_efficiency: float
    source: str


@dataclass(frozen=True)
class Cluster:
    device: Device
    gpus: int
    gpus_per_node: int
    intra: Link  # inside a node
    inter: Link | None  # between nodes (None: one node)
    # can communication run while the device computes? (this CPU's cores: no)
    overlap: bool = True

    def link(self, group: int) -> Link:
        """A group inside one node talks over the node's link; a wider one is as slow as
        the network."""
        if group <= self.gpus_per_node or self.inter is None:
            return self.intra
        return self.inter


@dataclass(frozen=True)
class Plan:
    strategy: str = "fsdp2"
    micro_batch: int = 1  # sequences per rank per forward
    seq_len: int = 1024
    accum: int = 1  # micro-batches per optimizer step
    ac: str = "none"
    ac_every: int = 2  # selective-layer: every k-th block checkpointed
    precision: str = "bf16"
    # bytes per gradient value communicated (fp32: DDP's and FSDP2's default)
    reduce_bytes: int = 4
    group: int | None = None  # hsdp: ranks that shard (the rest replicate)
    # reduce on every micro-batch, or only the last (no_sync)
    sync_every_micro_batch: bool = False
    # how the model state is kept: "fp32" (PyTorch's DDP under autocast, FSDP2's
    # MixedPrecisionPolicy: fp32 parameters, gradients and AdamW moments, 16 B/param) or
    # "bf16_mixed" (the ZeRO paper's and llm.c's: bf16 parameters and gradients, fp32
    # master weights and moments; the same 16 B, split 2 + 2 + 12)
    state: str = "fp32"


def gpu_cluster(
    gpu: str, gpus: int, gpus_per_node: int = 8, network: str | None = None
) -> Cluster:
    """A cluster of the GPUs in ``distlab.tools.hardware``: NVLink inside a node,
    ``network`` between nodes."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; choose one of {', '.join(GPUS)}")
    if network is not None and network not in NETWORKS:
        raise ValueError(
            f"unknown network {network!r}; choose one of {', '.join(NETWORKS)}"
        )
    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value}")
    g = GPUS[gpu]
    device = Device(
        g.label,
        g.bf16_peak,
        g.memory_bytes,
        g.hbm_bandwidth,
        g.matmul_efficiency,
        g.attention_efficiency,
        "distlab.tools.hardware",
    )
    nvlink = Link("NVLink", NVLINK_LAT, g.nvlink_bandwidth, "distlab.tools.hardware")
    net = NETWORKS[network] if network else None
    inter = Link(net.label, net.latency_s, net.bandwidth, net.source) if net else None
    return Cluster(device, gpus, min(gpus, gpus_per_node), nvlink, inter)


def check(shape: ModelShape, cluster: Cluster, plan: Plan) -> None:
    """One-line errors for plans that cannot run, listing the valid choices."""
    for value, options, what in (
        (plan.strategy, STRATEGIES, "strategy"),
        (plan.ac, AC_MODES, "activation checkpointing"),
        (plan.precision, PRECISIONS, "precision"),
        (plan.state, STATES, "model state"),
    ):
        if value not in options:
            raise ValueError(
                f"unknown {what} {value!r}; choose one of {', '.join(options)}"
            )
    for name in ("micro_batch", "accum", "seq_len", "ac_every"):
        if getattr(plan, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(plan, name)}")
    if (
        cluster.gpus < 1
        or cluster.gpus % cluster.gpus_per_node
        and cluster.gpus > cluster.gpus_per_node
    ):
        raise ValueError(
            f"{cluster.gpus} GPUs is not a whole number of nodes of "
            f"{cluster.gpus_per_node}"
        )
    if cluster.gpus > cluster.gpus_per_node and cluster.inter is None:
        raise ValueError(
            f"{cluster.gpus} GPUs span nodes of {cluster.gpus_per_node}: give "
            "the network between them"
        )
    if plan.seq_len > shape.max_seq_len and shape.gpt2:
        raise ValueError(
            f"seq_len {plan.seq_len} is longer than {shape.name}'s "
            f"{shape.max_seq_len} positions"
        )
    if plan.strategy == "hsdp" and (
        not plan.group or plan.group < 1 or cluster.gpus % plan.group
    ):
        raise ValueError(
            "hybrid sharding needs a group size that divides the "
            f"{cluster.gpus} GPUs, got {plan.group}"
        )
    # 1.5 sequences is not a plan
    for name in ("micro_batch", "accum", "seq_len", "ac_every"):
        if not isinstance(getattr(plan, name), int):
            raise ValueError(
                f"{name} must be a whole number, got {getattr(plan, name)}"
            )


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
        ZERO_STAGE[plan.strategy],
        plan.group,
    )
    g = bytes_per_param(plan.state)["grads"]
    accumulating = plan.accum > 1
    out = {
        "params": state["params"],
        "grads": state["grads"],
        "optimizer": state["optimizer"],
    }
    sharded = plan.strategy in ("fsdp2", "hsdp")
    if sharded:
        out["grads"] = (
            state["grads"] if accumulating and plan.sync_every_micro_batch else 0.0
        )
    elif accumulating:
        # the accumulated .grad, beside the buckets
        out["grads"] += g * shape.n_params()
    # FSDP2 holds the root and two whole blocks (the one computing, the one prefetched)
    # in the compute dtype
    out["gathered"] = (
        w * (shape.root_params() + 2 * shape.block_params()) if sharded else 0.0
    )
    whole = sharded and accumulating and not plan.sync_every_micro_batch
    out["grad buffers"] = g * shape.n_params() if whole else 0.0
    out["activations"] = activation_peak(
        shape, plan.micro_batch, plan.seq_len, plan.ac, plan.ac_every, w
    )
    out["total"] = sum(out.values())
    out["state"] = state["total"]
    out["capacity"] = cluster.device.memory_bytes
    out["fits"] = out["total"] <= FIT_FRACTION * cluster.device.memory_bytes
    return out


def activation_peak(
    shape: ModelShape, batch: int, seq_len: int, ac: str, every: int, w: int
) -> float:
    """Saved activations plus the most backward adds at one moment, as
    ``memory_calculator. activation_bytes`` works it out for the book's GPT (tested
    equal to it for those shapes)."""
    B, T, C, F, V, L = (
        batch,
        seq_len,
        shape.d_model,
        shape.ffn_hidden,
        shape.vocab_size,
        shape.n_layer,
    )
    block = (
        B
        * T
        * (w * shape.saved_values_per_token() + shape.saved_small_bytes_per_token(w))
    )
    checkpointed = {
        "none": 0,
        "full": L,
        "selective-layer": L // every,
        "selective-op": 0,
    }[ac]
    saved = (L - checkpointed) * block + checkpointed * w * B * T * C
    recompute = block if checkpointed else 0
    # keeps every other matmul's output and attention's: about half a block
    if ac == "selective-op":
        saved, recompute = L * block // 2, block // 2
    stats = 2 * w if shape.gpt2 else 4  # the final norm's statistics per token
    outside = (
        w * 2 * B * T * C + B * T * stats + 4 * B * T * V + 8 * (2 * B * T + T) + 4
    )
    freed = 4 * B * T * V + w * 2 * B * T * C + B * T * stats
    added = max(
        2 * 4 * B * T * V, recompute + w * (B * T * (C + F) + C * F + C + V * C) - freed
    )
    return saved + outside + added


# --- end memory ---


# --- begin compute ---
def block_seconds(shape: ModelShape, device: Device, plan: Plan) -> dict[str, float]:
    """One block's forward and backward on one rank for one micro-batch, and the head's
    (its matmul and the loss). Matmuls at ``matmul_efficiency`` of the peak; attention's
    two matmuls at ``attention_efficiency`` (a causal kernel does half of the 12*L*C*T
    the FLOP count reports); the non-matmul ops' bytes at the memory bandwidth.
    Backward: twice the forward's FLOPs."""
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
    # non-matmul ops and every other matmul
    recompute = {
        "none": 0.0,
        "full": fwd_mm + attn + fwd_mem,
        "selective-layer": (fwd_mm + attn + fwd_mem)
        * (shape.n_layer // plan.ac_every)
        / shape.n_layer,
        "selective-op": fwd_mm / 2 + fwd_mem,
    }[plan.ac]
    return {
        "forward": fwd_mm + attn + fwd_mem,
        "backward": 2 * fwd_mm
        + 2 * attn
        + w * values["backward"] * tokens / device.mem_bandwidth
        + recompute,
        "recompute": recompute,
        "head forward": head_mm + loss / 2,
        "head backward": 2 * head_mm + loss / 2,
        "matmul": 3 * shape.n_layer * fwd_mm + 3 * head_mm,
        "attention": 3 * shape.n_layer * attn,
        "memory-bound": shape.n_layer
        * w
        * sum(values.values())
        * tokens
        / device.mem_bandwidth
        + loss,
    }


# --- end compute ---


# --- begin predict ---
def predict(shape: ModelShape, cluster: Cluster, plan: Plan) -> dict:
    """Memory per rank and the time of one optimizer step: the compute of every
    micro-batch, the communication the compute does not hide, and the optimizer's update
    of this rank's parameters."""
    check(shape, cluster, plan)
    blocks = block_seconds(shape, cluster.device, plan)
    L, tokens = shape.n_layer, plan.micro_batch * plan.seq_len * plan.accum
    per_micro_batch = (
        L * (blocks["forward"] + blocks["backward"])
        + blocks["head forward"]
        + blocks["head backward"]
    )
    comm = communication(shape, cluster, plan, blocks)
    # ranks that share the update
    owners = {"ddp": 1, "hsdp": plan.group}.get(plan.strategy, cluster.gpus)
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
