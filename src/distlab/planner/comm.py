"""The communication half of the planner: each collective a strategy issues per step,
and how much of it the compute hides (``distlab.planner.predict`` adds it to the step).

    communication(shape, cluster, plan, block_seconds(shape, cluster.device, plan))

Which collectives run when is the strategy's row in ``distlab.costs.strategies``: DDP
all-reduces the gradients in buckets during backward (book/ddp_internals.md); ZeRO-1
and 2 reduce-scatter them and all-gather the updated parameters after the optimizer
step (book/zero_memory.md; the ZeRO paper's and llm.c's schedule); FSDP2 all-gathers
each block before its forward and again before its backward, and reduce-scatters its
gradients after (book/fsdp_communication.md), the next block's all-gather running
while the current one computes (book/fsdp_prefetch_offload.md); HSDP adds an all-reduce
of the reduced shards across the replicas. Each collective costs the ring of
``distlab.costs.collectives`` on the link its group spans. With ``cluster.overlap``
False nothing hides: every second of communication adds to the step (this machine's
CPU cores both compute and move gloo's bytes).
"""

from __future__ import annotations

import functools

from distlab.costs.buckets import steady_buckets, steady_ready, timeline
from distlab.costs.collectives import collective_s
from distlab.costs.strategies import strategy
from distlab.planner.shapes import ModelShape

# bytes of a value the forward computes in
PRECISIONS = {"fp32": 4, "bf16": 2}


# --- begin communication ---
def communication(shape: ModelShape, cluster, plan, blocks: dict[str, float]) -> dict:
    """Seconds of each collective per optimizer step on one rank, the seconds not
    hidden, and one reducing micro-batch's timeline (``lanes``)."""
    s = strategy(plan.strategy)
    n, L, w, rb = (
        cluster.gpus,
        shape.n_layer,
        PRECISIONS[plan.precision],
        plan.reduce_bytes,
    )
    # micro-batches whose gradients are reduced: one per step under no_sync, except with
    # ZeRO-2, whose gradients are sharded as they are produced
    syncs = plan.accum if plan.sync_every_micro_batch or plan.strategy == "zero2" else 1
    backward = L * blocks["backward"] + blocks["head backward"]
    if s.gathered is None:  # DDP, ZeRO-1, ZeRO-2: the whole gradient, in buckets
        link, (kind,) = cluster.link(n), s.backward
        sizes = steady_buckets(rb * shape.n_params())
        # all but two buckets are the same size: cost each size once
        cost = functools.cache(lambda b: collective_s(kind, b, n, link))
        run = timeline(backward, sizes, steady_ready(sizes), cost, cluster.overlap)
        out = {kind: syncs * run["comm"]}
        exposed = syncs * run["exposed"]
        for kind in s.after_step:  # each rank updated its shard: everyone needs all
            out[kind] = collective_s(kind, w * shape.n_params(), n, link)
            exposed += out[kind]
        return {"collectives": out, "exposed": exposed}
    g = plan.group if s.shards_over == "group" else n
    link, replicas = cluster.link(g), n // g
    across = cluster.link(n)

    def gather(params):
        return collective_s("all-gather", w * params, g, link)

    def scatter(params):
        return collective_s("reduce-scatter", rb * params, g, link)

    def replicate(params):
        return collective_s("all-reduce", rb * params / g, replicas, across)

    block, root = shape.block_params(), shape.root_params()
    ag, rs, ar = gather(block), scatter(block), replicate(block)
    costs = {
        "gather root": gather(root),
        "gather": ag,
        "regather": ag if "all-gather" in s.backward else 0.0,
        "reduce": rs + ar,
        "reduce root": scatter(root) + replicate(root),
    }
    lanes = {
        reducing: fsdp_timeline(L, blocks, costs, reducing, cluster.overlap)
        for reducing in (True, False)
    }
    out = {
        "all-gather": plan.accum
        * (costs["gather root"] + L * (ag + costs["regather"])),
        "reduce-scatter": syncs * (L * rs + scatter(root)),
    }
    if replicas > 1:
        out["all-reduce"] = syncs * (L * ar + replicate(root))
    return {
        "collectives": out,
        "exposed": syncs * lanes[True]["exposed"]
        + (plan.accum - syncs) * lanes[False]["exposed"],
        "lanes": lanes[True]["spans"],
    }


# --- end communication ---


# --- begin timeline ---
def fsdp_timeline(
    L: int, blocks: dict, costs: dict, reducing: bool = True, overlap: bool = True
) -> dict:
    """One micro-batch of a sharded step on two lanes, compute and communication (one
    stream, each collective after the one before): the root's gather, then each
    block's, the next one prefetched as soon as the block before it starts computing;
    the head, while the last block is gathered again; backward from the last block,
    each block regathered as the one after it starts, and, when ``reducing``, its
    gradients reduced as soon as its backward ends. ``overlap`` False: one lane does
    both, so nothing hides. Returns the spans (lane, label, start, end) and
    ``exposed``: how much later than the compute alone the micro-batch ends."""
    clock = {"compute": 0.0, "comm": 0.0}
    spans = []

    def run(lane: str, label: str, seconds: float, ready: float = 0.0) -> float:
        start = max(clock[lane], ready)
        if not overlap:  # one lane in truth: wait for the other too
            start = max(start, *clock.values())
        clock[lane] = start + seconds
        if seconds > 0:
            spans.append((lane, label, start, start + seconds))
        return start + seconds

    ready = run("comm", "gather root", costs["gather root"])
    ready = run("comm", "gather 0", costs["gather"], ready)
    for i in range(L):
        start = max(clock["compute"], ready)
        if i + 1 < L:  # prefetch: issued as block i starts
            ready = run("comm", f"gather {i + 1}", costs["gather"], start)
        run("compute", f"forward {i}", blocks["forward"], start)
    # the last block, resharded after its forward too, gathered again while the head
    # computes
    head = max(clock["compute"], ready)
    ready = run("comm", f"regather {L - 1}", costs["regather"], head)
    run("compute", "head", blocks["head forward"] + blocks["head backward"], head)
    for j in reversed(range(L)):
        start = max(clock["compute"], ready)
        if j > 0:
            ready = run("comm", f"regather {j - 1}", costs["regather"], start)
        end = run("compute", f"backward {j}", blocks["backward"], start)
        if reducing:
            run("comm", f"reduce {j}", costs["reduce"], end)
    if reducing:
        run("comm", "reduce root", costs["reduce root"], clock["compute"])
    compute = L * (blocks["forward"] + blocks["backward"])
    compute += blocks["head forward"] + blocks["head backward"]
    return {"spans": spans, "exposed": max(clock.values()) - compute}


# --- end timeline ---
