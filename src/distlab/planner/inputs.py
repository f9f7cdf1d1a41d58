"""The planner's inputs: a device, a cluster of them, a plan, and the checks that turn
an impossible plan into a one-line error.

    cluster = gpu_cluster("a100-80gb", gpus=64, gpus_per_node=8, network="ib-200g")
    plan = Plan("fsdp2", micro_batch=1, seq_len=8192, ac="full")
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.costs.collectives import Link
from distlab.costs.strategies import STRATEGIES as STRATEGY_ROWS
from distlab.planner.comm import PRECISIONS
from distlab.planner.hardware import CALL_LAT, GPUS, NET_LAT, NETWORKS, NVLINK_LAT
from distlab.planner.shapes import ModelShape

STRATEGIES = tuple(STRATEGY_ROWS)
AC_MODES = ("none", "full", "selective-op", "selective-layer")
OPTIMIZER = "adamw"
# FlashAttention's convention (FA2 paper): a causal forward does half of 4*C*T FLOPs per
# token and backward 2.5 times the forward (it recomputes the scores). The efficiencies
# in distlab.planner.hardware are stated in that convention, so attention is charged in
# it: 3.5 forward-units per step.
ATTENTION_BACKWARD = 2.5
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
    gpu: str,
    gpus: int,
    gpus_per_node: int = 8,
    network: str | None = None,
    busbw: float | None = None,
) -> Cluster:
    """A cluster of the GPUs in ``distlab.planner.hardware``: NVLink inside a node,
    ``network`` between nodes, at NCCL's bus bandwidth across nodes (a channel per NIC),
    or at ``busbw`` (bytes/s) where the reader measured it (nccl-tests' busbw of an
    all-reduce spanning the nodes, at the size of the shards or buckets)."""
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
        "distlab.planner.hardware",
    )
    if busbw is not None and not busbw > 0:
        raise ValueError(f"busbw must be a positive number of bytes/s, got {busbw}")
    nvlink = Link(
        "NVLink", NVLINK_LAT, g.nvlink_bandwidth, "distlab.planner.hardware", CALL_LAT
    )
    net = NETWORKS[network] if network else None
    inter = None
    if net:
        bw = busbw or net.busbw(g.nvlink_bandwidth)
        source = "measured (nccl-tests busbw)" if busbw else net.source
        inter = Link(net.label, NET_LAT, bw, source, CALL_LAT)
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
    if STRATEGY_ROWS[plan.strategy].shards_over == "group" and (
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
