"""The communication half of the planner: each collective a strategy issues per step,
and how much of it the compute hides (``distlab.tools.planner`` adds it to the step).

    communication(shape, cluster, plan, block_seconds(shape, cluster.device, plan))

The collectives per strategy are the ones the book counts on real ranks: DDP all-reduces
the gradients in buckets during backward (book/ddp_internals.md); ZeRO-1 and 2
reduce-scatter them and all-gather the updated parameters after the optimizer step
(book/zero_memory.md; the ZeRO paper's and llm.c's schedule: PyTorch's
ZeroRedundancyOptimizer runs on DDP, which all-reduces, and broadcasts each rank's
updated parameters, more bytes than this); FSDP2 all-gathers each block before its
forward and again before its backward, and reduce-scatters its gradients after
(book/fsdp_communication.md), the next block's all-gather running while the current one
computes (book/fsdp_prefetch_offload.md); hybrid sharding adds an all-reduce of the
reduced shards across the replicas. With ``cluster.overlap`` False nothing hides: every
second of communication adds to the step (this machine's CPU cores both compute and move
gloo's bytes).
"""

from __future__ import annotations

from distlab.tools.allreduce_costs import ring_s
from distlab.tools.shapes import ModelShape

# a rank's link: alpha per ring step, busbw each way
from distlab.tools.step_model import Link

DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default (book/ddp_internals.md)
DDP_FIRST_BUCKET_BYTES = 2**20  # dist._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket
# bytes of a value the forward computes in (the state: Plan.state)
PRECISIONS = {"fp32": 4, "bf16": 2}


# --- begin ring ---
def ring_seconds(kind: str, nbytes: float, group: int, link: Link) -> float:
    """The alpha-beta ring of book/collectives.md (``allreduce_costs.ring_s``): an
    all-reduce is a reduce-scatter and an all-gather back to back, each half of it."""
    if group < 2:
        return 0.0
    all_reduce = ring_s(nbytes, group, link.alpha, link.busbw)
    return {
        "all_gather": all_reduce / 2,
        "reduce_scatter": all_reduce / 2,
        "all_reduce": all_reduce,
    }[kind]


# --- end ring ---


def bucketed(
    backward: float, total_bytes: float, cost, overlap: bool
) -> tuple[float, float]:
    """DDP's buckets (book/ddp_overlap.md): backward produces gradient bytes at a steady
    rate, a bucket starts when its last byte is ready and the previous one is done.
    (time, exposed)."""
    first = min(DDP_FIRST_BUCKET_BYTES, total_bytes)  # then buckets of bucket_cap_mb
    full, last = divmod(total_bytes - first, DDP_BUCKET_BYTES)
    sizes = [first] + [DDP_BUCKET_BYTES] * int(full) + ([last] if last else [])
    end, done, comm = 0.0, 0.0, 0.0
    for size in sizes:
        done += size
        ready = backward * done / total_bytes if overlap else backward
        end = max(end, ready) + cost(size)
        comm += cost(size)
    return comm, max(0.0, end - backward)


# --- begin communication ---
def communication(shape: ModelShape, cluster, plan, blocks: dict[str, float]) -> dict:
    """Seconds of each collective per optimizer step on one rank, and the seconds
    not hidden."""
    n, L, w, rb = (
        cluster.gpus,
        shape.n_layer,
        PRECISIONS[plan.precision],
        plan.reduce_bytes,
    )
    # micro-batches whose gradients are reduced: one per step under no_sync, except with
    # ZeRO-2, whose gradients are sharded as they are produced (there is no whole
    # gradient to accumulate into)
    syncs = plan.accum if plan.sync_every_micro_batch or plan.strategy == "zero2" else 1
    backward = L * blocks["backward"] + blocks["head backward"]
    if plan.strategy in ("ddp", "zero1", "zero2"):
        link = cluster.link(n)
        kind = "all_reduce" if plan.strategy == "ddp" else "reduce_scatter"
        time, exposed = bucketed(
            backward,
            rb * shape.n_params(),
            lambda b: ring_seconds(kind, b, n, link),
            cluster.overlap,
        )
        out = {kind: syncs * time}
        exposed *= syncs
        # each rank updated its shard: everyone needs all of them, after the step
        if plan.strategy != "ddp":
            out["all_gather"] = ring_seconds(
                "all_gather", w * shape.n_params(), n, link
            )
            exposed += out["all_gather"]
        return {"collectives": out, "exposed": exposed}
    g = plan.group if plan.strategy == "hsdp" else n
    link, replicas = cluster.link(g), n // g
    across = cluster.inter if cluster.gpus > cluster.gpus_per_node else cluster.intra

    def gather(params):
        return ring_seconds("all_gather", w * params, g, link)

    def scatter(params):
        return ring_seconds("reduce_scatter", rb * params, g, link)

    def replicate(params):
        return ring_seconds("all_reduce", rb * params / g, replicas, across)

    block, root = shape.block_params(), shape.root_params()
    ag, rs, ar = gather(block), scatter(block), replicate(block)
    hide = (
        (lambda comm, compute: max(0.0, comm - compute))
        if cluster.overlap
        else (lambda comm, compute: comm)
    )
    # forward: the root's gather, then each block's, prefetched while the block before
    # it computes
    forward = gather(root) + ag + (L - 1) * hide(ag, blocks["forward"])
    # backward: each block gathered again and, on a reducing micro-batch, its gradients
    # reduced while the next block computes; the last reduction (and the root's) runs
    # after the compute has ended
    tail = rs + ar + scatter(root) + replicate(root)
    reducing = (
        forward
        + (L - 1) * hide(ag + rs + ar, blocks["backward"])
        + (ag if not cluster.overlap else 0)
        + tail
    )
    quiet = (
        forward
        + (L - 1) * hide(ag, blocks["backward"])
        + (ag if not cluster.overlap else 0)
    )
    out = {
        "all_gather": plan.accum * (gather(root) + 2 * L * ag),
        "reduce_scatter": syncs * (L * rs + scatter(root)),
    }
    if replicas > 1:
        out["all_reduce"] = syncs * (L * ar + replicate(root))
    return {
        "collectives": out,
        "exposed": syncs * reducing + (plan.accum - syncs) * quiet,
    }


# --- end communication ---
