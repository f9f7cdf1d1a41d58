"""What a collective of n bytes costs, in the alpha-beta model with NCCL's own
latencies: the one place the book writes these formulas.

    collective_s("all-reduce", nbytes, ranks, link)   the ring, for any collective
    ring_bytes_sent("all-gather", nbytes, ranks)      what one rank sends on a ring
    cross_node_busbw(nics, nic_bw, intra_busbw)       NCCL's channels, one per NIC

    ring_s(n, N, alpha, B)               2(N-1) alpha + 2(N-1)/N n/B
    halving_doubling_s(n, N, alpha, B)   2 log2(N) alpha + 2(N-1)/N n/B
    tree_s(n, M, g, intra, inter)        NCCL's tree: a chain of the g GPUs inside each
                                         node, a double binary tree across the M nodes
    in_network_s(n, latency, algbw)      the switch sums (NVLS, SHARP): n/algbw
    hierarchical_s(n, M, g, intra, inter)
                                         reduce-scatter in the node, all-reduce of 1/g
                                         of it across nodes, all-gather in the node

Each is a model with its assumptions written beside it; none is a measurement. B is one
direction of a rank's link, the "busbw" of nccl-tests (links are full duplex: a rank
sends and receives at once). The constants below are NCCL's tuning model and two
measurements by NCCL's maintainer, each with its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# NCCL's tuning model, src/graph/tuning.cc (baseLat, hwLat and ncclTopoGetAlgoTime),
# read at a 2.2x release (the one with Blackwell rows). The page's earlier source,
# NCCL 2.7.5 (2020), had 9.6 us for a network step and 28 us for an NVLink tree step.
NCCL_TUNING = "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc"
# Simple protocol (the one for MiB-sized messages such as DDP's buckets), seconds
BASE_SIMPLE = 8.4e-6  # baseLat, Ring and Tree: once per call
RING_NVLINK = 3.4e-6  # hwLat NVLink, Ring: per ring step
TREE_NVLINK = 4.0e-6  # hwLat NVLink, Tree: per step of the chain inside a node
NET_STEP = 14e-6  # hwLat Net, Ring and Tree: per step over the network
RING_PLATEAU = 1.4  # a multi-node Ring/Simple all-reduce's latency x 1.4 (sm80 and on)
NVLS_LATENCY = 25e-6  # hwLat NVLink, NVLS: the whole in-node all-reduce, no base
# LL protocol (small messages): baseLat 6.6 us, hwLat 0.6 us per NVLink ring step, and
# a bus bandwidth of at most llMaxBw (Hopper, one node: 141 GB/s)
LL_BASE, LL_NVLINK, LL_MAX_BUSBW = 6.6e-6, 0.6e-6, 141e9
# Measured on 8 H100s, quoted by NCCL's maintainer in nccl-tests#212: the ring's busbw
# (NCCL_ALGO=Ring; NVLink's line rate is 450 GB/s each way) and NVLS's algbw.
NCCL_TESTS_212 = "https://github.com/NVIDIA/nccl-tests/issues/212"
NVLINK_BUSBW = 370e9
NVLS_ALGBW = 275e9


def ring_s(n: float, ranks: int, alpha: float, bandwidth: float) -> float:
    """2(N-1) steps, each moving n/N bytes per rank: ``collective_s``'s all-reduce."""
    return collective_s("all-reduce", n, ranks, Link("ring", alpha, bandwidth, ""))


def halving_doubling_s(n: float, ranks: int, alpha: float, bandwidth: float) -> float:
    """log2(N) halving steps, then log2(N) doubling steps: the ring's bytes, in
    fewer messages."""
    return 2 * math.log2(ranks) * alpha + 2 * (ranks - 1) / ranks * n / bandwidth


def tree_s(
    n: float,
    nodes: int,
    per_node: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    base: float = 0.0,
) -> float:
    """NCCL's tree all-reduce: a reduce up, then a broadcast down, pipelined in chunks.
    Inside a node the g GPUs form a chain, across nodes a double binary tree
    (nvidia/nccl#919: "The tree is only between nodes. Within a single node, it is
    indeed just a chain"). NCCL's latency: 2((g-1) alpha_intra + log2(M) alpha_inter).
    Each rank sends n going up and n coming down, so the algorithm bandwidth is half
    the bus bandwidth (NCCL's ratio .5): 2n/B, B the slower of the two levels."""
    (a_in, b_in), (a_out, b_out) = intra, inter
    latency = base + 2 * ((per_node - 1) * a_in + math.log2(nodes) * a_out)
    return latency + 2 * n / (b_in if nodes == 1 else min(b_in, b_out))


def in_network_s(n: float, latency: float, algbw: float) -> float:
    """The switch sums: each rank sends its n bytes once and receives the n-byte sum
    once (NVLink SHARP in an NVSwitch node, InfiniBand SHARP between nodes)."""
    return latency + n / algbw


def hierarchical_s(
    n: float,
    nodes: int,
    per_node: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    nics_per_node: int = 0,
    base: float = 0.0,
) -> float:
    """Ring reduce-scatter inside each node (each GPU ends with 1/g of the node's sum),
    ring all-reduce of that 1/g across the nodes, ring all-gather inside the node, one
    after the other, each paying ``base``. ``intra`` and ``inter`` are (alpha,
    bandwidth); ``inter``'s bandwidth is one NIC's. With a NIC per GPU
    (``nics_per_node`` = g, the default) the g cross-node all-reduces run side by side;
    with fewer NICs they share them."""
    g, (a_in, b_in), (a_out, b_out) = per_node, intra, inter
    nics = nics_per_node or g
    # reduce-scatter or all-gather
    half_in_node = collective_s(
        "reduce-scatter", n, g, Link("node", a_in, b_in, "", base)
    )
    share = b_out * min(nics, g) / g  # each GPU's share of the node's network bandwidth
    across = base + ring_s(n / g, nodes, a_out, share) if nodes > 1 else 0.0
    return 2 * half_in_node + across


def algorithms_one_node(n: float, ranks: int = 8) -> dict[str, float]:
    """Seconds per algorithm for ``ranks`` H100s of one NVSwitch node, with NCCL's
    latencies and the measured bandwidths above."""
    ll_algbw = min(LL_MAX_BUSBW, NVLINK_BUSBW / 2) * ranks / (2 * (ranks - 1))
    nvlink = (TREE_NVLINK, NVLINK_BUSBW)
    return {
        "ring, LL": LL_BASE + 2 * (ranks - 1) * LL_NVLINK + n / ll_algbw,
        "ring": BASE_SIMPLE + ring_s(n, ranks, RING_NVLINK, NVLINK_BUSBW),
        "tree (a chain)": tree_s(n, 1, ranks, nvlink, nvlink, BASE_SIMPLE),
        "NVLS (switch sums)": in_network_s(n, NVLS_LATENCY, NVLS_ALGBW),
    }


def algorithms_across_nodes(
    n: float, nodes: int, per_node: int, nic_bandwidth: float
) -> dict[str, float]:
    """Seconds per algorithm for ``nodes`` x ``per_node`` H100s, a NIC per GPU. Every
    algorithm gets a channel per NIC: NCCL runs several rings and trees side by side
    ("a tree pair per NIC", nvidia/nccl#545), each leaving the node through its own NIC,
    and takes their bus bandwidth as channels x a channel's speed (``busBw = nChannels
    * bw`` in tuning.cc), here at most NVLink's. The ring's latency is NCCL's: 2(N-1)
    steps, 2(M-1) of them over the network, times the plateau factor."""
    ranks, g = nodes * per_node, per_node
    busbw = cross_node_busbw(g, nic_bandwidth, NVLINK_BUSBW)
    net_steps = 2 * (nodes - 1)
    ring_latency = RING_PLATEAU * (
        BASE_SIMPLE + (2 * (ranks - 1) - net_steps) * RING_NVLINK + net_steps * NET_STEP
    )
    intra, inter = (TREE_NVLINK, NVLINK_BUSBW), (NET_STEP, g * nic_bandwidth)
    return {
        "ring": ring_latency + 2 * (ranks - 1) / ranks * n / busbw,
        "tree": tree_s(n, nodes, g, intra, inter, BASE_SIMPLE),
        "hierarchical": hierarchical_s(
            n,
            nodes,
            g,
            (RING_NVLINK, NVLINK_BUSBW),
            (NET_STEP, nic_bandwidth),
            base=BASE_SIMPLE,
        ),
    }


# --- begin link ---
@dataclass(frozen=True)
class Link:
    """What one rank's collectives run over: a per-step latency, a bus bandwidth
    (bytes/s) and a latency paid once per call."""

    name: str
    alpha: float  # seconds per ring step
    busbw: float  # bytes per second each rank's link moves, the nccl-tests "busbw"
    source: str  # where the numbers come from
    base: float = 0.0  # seconds once per call (NCCL's baseLat)


# --- end link ---


# --- begin ring ---
# bytes one rank sends per tensor byte on a ring of N ranks, and the ring's steps. S is
# the whole tensor: an all-gather's output, a reduce-scatter's input. An all-reduce is a
# reduce-scatter and an all-gather back to back; a broadcast's chain sends (N-1)/N S per
# rank on average (the root and every rank but the last send S).
RING_FACTOR = {
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
}
RING_STEPS = {
    "all-gather": lambda n: n - 1,
    "reduce-scatter": lambda n: n - 1,
    "all-reduce": lambda n: 2 * (n - 1),
    "broadcast": lambda n: n - 1,
}


def ring_bytes_sent(kind: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends for a ``kind`` collective of an ``nbytes`` tensor."""
    return RING_FACTOR[kind](ranks) * nbytes


def collective_s(kind: str, nbytes: float, ranks: int, link: Link) -> float:
    """The ring's time: the link's per-call latency, alpha per step, and the bytes one
    rank sends at the bus bandwidth. A group of one sends nothing."""
    if ranks < 2:
        return 0.0
    return (
        link.base
        + RING_STEPS[kind](ranks) * link.alpha
        + ring_bytes_sent(kind, nbytes, ranks) / link.busbw
    )


def ring_all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """``collective_s`` for an all-reduce: the ring of book/collectives.md."""
    return collective_s("all-reduce", nbytes, ranks, link)


# --- end ring ---


# --- begin channels ---
def cross_node_busbw(
    nics_per_node: int, nic_bandwidth: float, intra_busbw: float
) -> float:
    """The bus bandwidth of a collective whose ring spans nodes. NCCL runs a channel
    (a ring, or a tree pair) through each NIC side by side and takes their sum: ``busBw
    = nChannels * bw`` in tuning.cc. So a node with 8 NICs of 25 GB/s moves 200 GB/s per
    GPU, not 25, unless the link inside the node is slower (nvidia/nccl#812: 8 x 200
    Gb/s HDR, 192 GB/s all-reduce busbw measured on a DGX A100)."""
    return min(nics_per_node * nic_bandwidth, intra_busbw)


# --- end channels ---
