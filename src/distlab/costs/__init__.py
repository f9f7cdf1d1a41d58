"""The cost model: pure arithmetic, each formula written once, imported by every other
role (the training library included) and importing nothing of distlab.

    collectives   a collective's time on a ring (and tree, halving-doubling,
                  in-network, hierarchical) with NCCL's latencies; the bytes a rank
                  sends; NCCL's channel per NIC across nodes
    buckets       DDP's buckets and the timeline of their all-reduces
    state         bytes of model state per rank (the ZeRO paper's count)
    strategies    the data-parallel strategies as rows: what each shards, over which
                  group, which collectives run when, what is whole at the peak
    activations   what a block keeps for backward per token: the book's GPT-2 block,
                  and torchtitan's Llama block under none / selective-op / full
    flops         training FLOPs per token, as MFU reports count them
"""
