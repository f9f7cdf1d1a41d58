"""torchtitan's H100 runs that use FSDP only: the published figures that state a memory
per GPU.

    from distlab.planner.runs.torchtitan_h100 import RUNS
    [
        (run["name"], run["published"]["memory_bytes_per_gpu"] / 2**30)
        for run in RUNS
    ]

Same schema as ``distlab.planner.runs.torchtitan_a100.RUNS`` plus
``published["memory_kind"]``. Kept in its own module so that file stays under the house
limit of 300 lines. Of the seven rows only two (eager, bf16) match what the planner
models; the other five use torch.compile and/or Float8 and are recorded for completeness
(``plan["compile"]``, ``plan["float8"]``), not for a fair check.
"""

from __future__ import annotations

from distlab.planner.runs.torchtitan_a100 import TT, TT_DEFAULTS, _llama3

# The newest docs/performance.md: every H100 table. It names the code it measured: torch
# 1963fc8 (2024/12/23), torchao eab345c, torchtitan 9dec370 (2024/12/26). No file of
# torchtitan 9dec370 is stored in the search corpora; the config and code cited below
# are the stored versions nearest to it (each says so).
TT_H100_DOC = TT + "eaea6f6a2fa940f03a10906be1df3489cf30af85/docs/performance.md"
# The 8B toml of the CP era (it has [experimental] context_parallel_degree): batch_size
# 1, seq_len 8192, mode 'selective', selective_ac_option 'op', compile false,
# enable_float8_linear false, AdamW lr 3e-4
TT_8B_TOML_CP = (
    TT + "6e55afaa7dba43e3f36782f0955dfb04467500ec/train_configs/llama3_8b.toml"
)
TT_SAC = TT + (
    "582fe7d1f52ef96987a9d5265b3e2bbefc92d583/"
    "torchtitan/parallelisms/parallelize_llama.py"
)
TT_MEMORY = (
    "torchtitan logs two peaks from torch.cuda.memory_stats: max_active_gib "
    "('active_bytes.all.peak') and "
    "max_reserved_gib ('reserved_bytes.all.peak'), reset after every log line "
    "(DeviceMemoryMonitor, "
    + TT
    + "021137a763b0ff008e8143c88e5fa14280bcb7d3/torchtitan/metrics.py). The "
    "console line prints only the reserved "
    "one: 'memory: {gpu_mem_stats.max_reserved_gib:5.2f}GiB' ("
    + TT
    + "0011fb905e9561a51af0f265e35d989f7448b1d8"
    "/train.py). The doc's column is 'Memory(GiB)' and does not say which peak; "
    "reserved is the likely reading "
    "(the one printed), not a stated fact. Footnote 1: 'memory readings are "
    "stable across the whole training "
    "process'; 'We take the maximum across all GPUs'"
)
MEMORY_KIND = "max_reserved (likely; the doc says only 'Memory(GiB)')"
TT_H100_MFU = (
    "Not reported per row: 'We do not report Model FLOPS Utilization (MFU) "
    "because when Float8 is enabled ... "
    "the definition of MFU under such scenario is not well-defined. We note "
    "that the 1D Llama 3.1 8B model "
    "training on 8 or 128 H100 GPUs without Float8 achieves 33% to 39% MFU "
    "(with or without torch.compile, "
    "respectively)'; footnote 2: the peak used is the SXM's (989e12), above "
    "this part's, so the MFU is low. "
    "torchtitan's count: 6*N + 12*L*H*Q*T with N excluding the token embedding "
    "(get_num_flop_per_token, "
    + TT
    + "9fd2b5172bcb9a5c49d18c75c3ab833abe990819/torchtitan/utils.py). Check: "
    "6*7.5049e9 + 12*32*32*128*8192 = "
    "57.91e9 FLOP/token; x 5762 / 989e12 = 33.7%, x 6667 = 39.0%: so 33% is the "
    "EAGER row and 39% the compiled "
    "one ('respectively' in the doc has them the other way round)"
)
GRAND_TETON_NOTE = (
    "'Each host has 8 NVIDIA H100 GPUs fully connected with NVLink'; 'Hosts are "
    "inter-connected with backend RDMA "
    "network with 400 Gb/s per GPU'. The doc says RDMA, not InfiniBand (it "
    "could be RoCE); ib-400g is used for "
    "its line rate, one 400 Gb/s NIC per GPU, which is all the planner models of it"
)
TT_H100_PLAN = {
    # 'FSDP' in 1D tables; data_parallel_shard_degree = -1 in the toml (all ranks)
    "strategy": "fsdp2",
    # derived: 'global batch size 16' = local 2 x 8 GPUs (256 = 2 x 128):
    # no accumulation
    "accum_steps": 1,
    # toml sets none: defaults mixed_precision_param / _reduce (TT_DEFAULTS)
    "param_dtype": "bfloat16",
    "reduce_dtype": "float32",
    # apply_fsdp (TT_SAC, a nearby version)
    "reshard_after_forward": "every block but the last; root resharded",
    "attention": "F.scaled_dot_product_attention(is_causal=True)",
    "optimizer": "AdamW",  # the toml's
}
SELECTIVE_OP_H100 = (
    "per transformer block: save the outputs of aten.mm (except every second "
    "mm), SDPA flash/efficient attention, "
    "reduce_scatter_tensor and aten.max; recompute the rest (_save_list, "
    + TT_SAC
    + ")"
)
SEL_NOTE = (
    "Not stated: which selective AC. The doc says 'Selective activation "
    "checkpointing'; the 8B toml (TT_8B_TOML_CP) "
    "sets selective_ac_option = 'op', assumed here. Local batch 2 overrides the "
    "toml's batch_size = 1; seq_len 8192 "
    "is the toml's (the doc gives none for tables 1 and 3). "
)
EAGER_NOTE = (
    "compile and Float8 off: the one kind of row the planner (eager bf16) can be "
    "checked against fairly. "
)
COMPILED_NOTE = (
    "torch.compile on: the planner models eager kernels, so it is NOT a fair check "
    "of its tokens/s. "
)
FLOAT8_NOTE = (
    "torch.compile and Float8 linears (torchao) on: NOT comparable with the "
    "planner, which models bf16 matmuls. "
)


def _tt_h100(
    name, table, row, *, gpus, batch, seq_len, ac, compile, float8, tps, gib, notes
):
    """One row of the doc; ``row`` is the table line as written, quoted with its
    table caption."""
    return {
        "name": name,
        "title": (
            f"torchtitan Llama 3.1 8B, {row.split('|')[1].strip()}, on {gpus} H100 "
            "96GB (500 W)"
        ),
        "source": TT_H100_DOC,
        "quote": table + " " + row,
        # Llama 3.1 8B: the same sizes as Llama 3 8B
        "model": _llama3(32, 4096, 32, 14336, seq_len),
        "gpu": "h100-96gb-500w",
        "gpus": gpus,
        "gpus_per_node": 8,  # 'Each host has 8 NVIDIA H100 GPUs'
        "network": "ib-400g" if gpus > 8 else None,
        "network_note": GRAND_TETON_NOTE
        + ("" if gpus > 8 else "; one host here, so all traffic is NVLink"),
        "plan": {
            **TT_H100_PLAN,
            "micro_batch": batch,
            "ac": ac,
            "compile": compile,
            "float8": float8,
        },
        "published": {
            "tokens_per_s_per_gpu": tps,
            "mfu": None,  # not reported per row (TT_H100_MFU)
            # GiB, as torchtitan's _to_gib divides by 1024**3
            "memory_bytes_per_gpu": gib * 2**30,
            "memory_kind": MEMORY_KIND,
            "memory_note": TT_MEMORY,
            "mfu_flops_convention": TT_H100_MFU,
        },
        "notes": notes
        + "TPS/GPU 'calculated and logged every 10 iterations, and always read at "
        "the ... 90th "
        "iteration'. torchtitan's defaults of the period: " + TT_DEFAULTS,
    }


T1 = (
    "Table 1: '1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch "
    "size 2, global batch size 16. "
    "Selective activation checkpointing.'"
)
T2 = (
    "Table 2: 'FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. "
    "Local batch size 1. Full "
    "activation checkpointing.'"
)
T3 = (
    "Table 3: '1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch "
    "size 2, global batch size 256. "
    "Selective activation checkpointing.'"
)
SEL = {"mode": "selective-op", "policy": SELECTIVE_OP_H100}
RUNS = [
    _tt_h100(
        "torchtitan-h100-8b-fsdp-8gpu",
        T1,
        "| FSDP | 5,762 | 82.4 |",
        gpus=8,
        batch=2,
        seq_len=8192,
        ac=SEL,
        compile=False,
        float8=False,
        tps=5762,
        gib=82.4,
        notes=EAGER_NOTE + SEL_NOTE,
    ),
    _tt_h100(
        "torchtitan-h100-8b-fsdp-compile-8gpu",
        T1,
        "| FSDP + torch.compile | 6,667 | 77.0 |",
        gpus=8,
        batch=2,
        seq_len=8192,
        ac=SEL,
        compile=True,
        float8=False,
        tps=6667,
        gib=77.0,
        notes=COMPILED_NOTE + SEL_NOTE,
    ),
    _tt_h100(
        "torchtitan-h100-8b-fsdp-compile-float8-8gpu",
        T1,
        "| FSDP + torch.compile + Float8 | 8,532 | 76.8 |",
        gpus=8,
        batch=2,
        seq_len=8192,
        ac=SEL,
        compile=True,
        float8=True,
        tps=8532,
        gib=76.8,
        notes=FLOAT8_NOTE + SEL_NOTE,
    ),
    _tt_h100(
        "torchtitan-h100-8b-fsdp-128gpu",
        T3,
        "| FSDP | 5,605 | 67.0 |",
        gpus=128,
        batch=2,
        seq_len=8192,
        ac=SEL,
        compile=False,
        float8=False,
        tps=5605,
        gib=67.0,
        notes=EAGER_NOTE + SEL_NOTE,
    ),
    _tt_h100(
        "torchtitan-h100-8b-fsdp-compile-128gpu",
        T3,
        "| FSDP + torch.compile | 6,514 | 62.0 |",
        gpus=128,
        batch=2,
        seq_len=8192,
        ac=SEL,
        compile=True,
        float8=False,
        tps=6514,
        gib=62.0,
        notes=COMPILED_NOTE + SEL_NOTE,
    ),
    _tt_h100(
        "torchtitan-h100-8b-fsdp-compile-float8-128gpu",
        T3,
        "| FSDP + torch.compile + Float8 | 8,380 | 61.8 |",
        gpus=128,
        batch=2,
        seq_len=8192,
        ac=SEL,
        compile=True,
        float8=True,
        tps=8380,
        gib=61.8,
        notes=FLOAT8_NOTE + SEL_NOTE,
    ),
    # 'FSDP 8, CP 1' is FSDP alone (a context-parallel degree of 1 is no CP), at a
    # 32768-token sequence
    _tt_h100(
        "torchtitan-h100-8b-fsdp-32k-compile-float8-8gpu",
        T2,
        "| FSDP 8, CP 1 | 32768 | 3,890 | 83.9 |",
        gpus=8,
        batch=1,
        seq_len=32768,
        ac={"mode": "full"},
        compile=True,
        float8=True,
        tps=3890,
        gib=83.9,
        notes=FLOAT8_NOTE
        + "Full AC: every block wrapped by checkpoint_wrapper (TT_SAC). Sequence "
        "length "
        "32768 and local batch 1 are the table's; the doc states no global "
        "batch (8 x 1 = 8 sequences, "
        "derived). ",
    ),
]
