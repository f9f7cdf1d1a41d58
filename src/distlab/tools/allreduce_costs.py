"""What an all-reduce of n bytes costs with each algorithm, in the alpha-beta model.

    ring_s(n, N, alpha, B)                2(N-1) alpha + 2(N-1)/N n/B
    tree_s(n, N, alpha, B)                2 log2(N) alpha + 2 n/B
                                          (double binary tree, pipelined)
    in_network_s(n, alpha, B)             2 alpha + n/B
                                          (NVLS, SHARP: the switch adds)
    hierarchical_s(n, nodes, per_node, intra, inter)
                                          reduce-scatter in the node, all-reduce of 1/g
                                          of it across nodes, all-gather in the node
    halving_doubling_s(n, N, alpha, B)    2 log2(N) alpha + 2(N-1)/N n/B

Each is a model with its assumptions written beside it; none is a measurement. B is one
direction of a rank's link (links are full duplex: a rank sends and receives at once).
"""

from __future__ import annotations

import math


def ring_s(n: float, ranks: int, alpha: float, bandwidth: float) -> float:
    """2(N-1) steps, each moving n/N bytes per rank."""
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * n / bandwidth


def halving_doubling_s(n: float, ranks: int, alpha: float, bandwidth: float) -> float:
    """log2(N) halving steps, then log2(N) doubling steps: the ring's bytes, in
    fewer messages."""
    return 2 * math.log2(ranks) * alpha + 2 * (ranks - 1) / ranks * n / bandwidth


def tree_s(n: float, ranks: int, alpha: float, bandwidth: float) -> float:
    """A reduce up a binary tree, then a broadcast down, pipelined in chunks: a latency
    of the tree's depth each way, and each rank sends about n going up and n coming
    down. NCCL's double binary tree splits the data over two trees so that every rank's
    link is busy both ways; its tuning model likewise takes a tree's algorithm bandwidth
    as half its bus bandwidth (2 n / B)."""
    return 2 * math.log2(ranks) * alpha + 2 * n / bandwidth


def in_network_s(n: float, alpha: float, bandwidth: float) -> float:
    """The switch sums: each rank sends its n bytes once and receives the n-byte sum
    once, both directions at the same time (NVLink SHARP in an NVSwitch node, InfiniBand
    SHARP between nodes)."""
    return 2 * alpha + n / bandwidth


def hierarchical_s(
    n: float,
    nodes: int,
    per_node: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    nics_per_node: int = 0,
) -> float:
    """Ring reduce-scatter inside each node (each GPU ends with 1/g of the node's sum),
    ring all-reduce of that 1/g across the nodes, ring all-gather inside the node.
    ``intra`` and ``inter`` are (alpha, bandwidth); ``inter``'s bandwidth is one NIC's.
    With a NIC per GPU (``nics_per_node`` = g, the default) the g cross-node all-reduces
    run side by side; with fewer NICs they share them."""
    g, (a_in, b_in), (a_out, b_out) = per_node, intra, inter
    nics = nics_per_node or g
    # reduce-scatter or all-gather
    half_in_node = (g - 1) * a_in + (g - 1) / g * n / b_in if g > 1 else 0.0
    share = b_out * min(nics, g) / g  # each GPU's share of the node's network bandwidth
    across = ring_s(n / g, nodes, a_out, share) if nodes > 1 else 0.0
    return 2 * half_in_node + across


def algorithms_one_node(
    n: float, ranks: int, nvlink: tuple[float, float]
) -> dict[str, float]:
    """Seconds per algorithm for ``ranks`` GPUs of one NVSwitch node."""
    alpha, bw = nvlink
    return {
        "ring": ring_s(n, ranks, alpha, bw),
        "tree": tree_s(n, ranks, alpha, bw),
        "NVLS (in-switch sum)": in_network_s(n, alpha, bw),
    }


def algorithms_across_nodes(
    n: float,
    nodes: int,
    per_node: int,
    nvlink: tuple[float, float],
    nic: tuple[float, float],
) -> dict[str, float]:
    """Seconds per algorithm for ``nodes`` x ``per_node`` GPUs, a NIC per GPU. A single
    ring or tree (one *channel*) sends all its bytes through one NIC per hop (the
    slowest link of its path); NCCL runs several channels side by side, each leaving the
    node through its own NIC, and takes their bus bandwidth as channels x a channel's
    speed (``busBw = nChannels * speed`` in its ``tuning.cc``): the ring with a channel
    per NIC. The hierarchical all-reduce uses NVLink inside the node and all g NICs
    across; with SHARP the same hierarchy has the network switch sum the 1/g pieces
    (what NCCL's CollNet algorithms do)."""
    ranks, (a_out, b_out) = nodes * per_node, nic
    return {
        "ring, one channel": ring_s(n, ranks, a_out, b_out),
        "tree, one channel": tree_s(n, ranks, a_out, b_out),
        "ring, a channel per NIC": ring_s(n, ranks, a_out, b_out * per_node),
        "hierarchical": hierarchical_s(n, nodes, per_node, nvlink, nic),
        "hierarchical + SHARP": hierarchical_s(n, 1, per_node, nvlink, nic)
        + in_network_s(n / per_node, a_out, b_out),
    }
