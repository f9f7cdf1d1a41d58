"""MosaicML llm-foundry's MPT throughput tables: FSDP FULL_SHARD runs on A100 80GB, A100
40GB and H100 80GB, quoted row by row.

    from distlab.planner.runs.llm_foundry import RUNS
    [(run["name"], run["published"]["tokens_per_s_per_gpu"]) for run in RUNS]

Every row is data parallel only ('Sharding Strategy' FULL_SHARD, no tensor or pipeline
parallel). Each run is built from its table row, kept verbatim in ``ROWS``: the numbers
in ``plan`` and ``published`` are parsed from that quote, nothing else. The tables give
no memory per GPU. GPU and network keys refer to the planner's hardware catalogue;
"a100-40gb" is a key that catalogue does not have yet.
"""

from __future__ import annotations

LF = "https://github.com/mosaicml/llm-foundry/blob/"
LF_COMMIT = LF + "061f2c7ce64e655100286584a7629e2a09f827ba/"
# The tables (26 versions stored; this one has the H100 BF16/FP8 and both A100 tables)
README = LF_COMMIT + "scripts/train/benchmarking/README.md"
# Same commit: how each column is computed from the run's logs and config
COLLECT = LF_COMMIT + "scripts/train/benchmarking/collect_results.py"
SUBMIT = LF + (
    "12a631913c786ac70e33e42047d2eae6f443ee69/"
    "scripts/train/benchmarking/submit_benchmarks.py"
)
SWEEP = (
    LF + "2542a2e26dd7a958d0a1d4deb3712e956503ecdd/scripts/train/benchmarking/sweep.sh"
)
MPT_CONFIG = LF + (
    "0085285a957badb20c34a462551d25aa5c0a5fc1/llmfoundry/models/mpt/configuration_mpt.py"
)
MPT_MODEL = LF + (
    "0085285a957badb20c34a462551d25aa5c0a5fc1/llmfoundry/models/mpt/modeling_mpt.py"
)
YAMLS = (
    LF
    + "<commit>/scripts/train/yamls/pretrain/mpt-<size>.yaml, commits: "
    + (
        "125m/350m 2a59782a, 760m/30b 39393a21, 1b 06560d59, 3b 34c28fc9, 7b 15fb4ffa, "
        "13b 309f6837, 70b 17e6d631"
    )
)
COMPOSER_MP = (
    "https://github.com/mosaicml/composer/blob/"
    "0099561e6d40b233affd54d420d4e3582e9cacd8/composer/trainer/mosaic_fsdp_utils.py"
)

# (n_layers, d_model, n_heads) from each mpt-<size>.yaml (YAMLS); every yaml has
# expansion_ratio 4 and vocab_size 50368
SHAPES = {
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}
MODEL_SOURCE = (
    YAMLS + " ; MPTConfig defaults (" + MPT_CONFIG + "): learned_pos_emb=True, "
    "no_bias=False, tie_word_embeddings=True, norm_type 'low_precision_layernorm', "
    "ffn_type 'mptmlp' (d -> 4d, GELU, 4d -> d). Checked against the table's "
    "NumParams: "
    "12*L*d^2 + 13*L*d + 50368*d + T*d + 2*d (tied embedding, a learned position "
    "table of T = max_seq_len rows, biases on every linear, LayerNorm weight and bias) "
    "equals NumParams exactly for every row quoted here, so the runs had no ALiBi and "
    "one embedding matrix"
)
MFU_CONVENTION = (
    "README 'MFU': (3*flops_per_seq + 3*attn_flops_per_seq) * seq_per_sec / (gpu_num * "
    "GPU_AVAILABLE_FLOPS), flops_per_seq = 2*n_params*seq_len, attn_flops_per_seq = "
    "n_layers*2*2*d_model*seq_len^2: per token 6*N + 12*L*d*T, N = ALL parameters "
    "(embedding and position table included), attention NOT halved for causal. Peak "
    "from composer's GPU_AVAILABLE_FLOPS; collect_results maps any 'h100' to "
    "'h100-sxm' "
    "(" + COLLECT + "). Recomputing MFU from each quoted row with 312e12 (A100, both "
    "sizes) and 989e12 (H100) reproduces the MFU column to +-0.07 points (T/s/GPU is "
    "truncated by int()). HFU = MFU x 4/3 when AC is on (one extra forward)"
)
THROUGHPUT_NOTE = (
    "Throughput (S/s) is the last 'throughput/samples_per_sec' in the run's log, "
    "T/s/GPU = int(S/s * seq_len / gpus) (" + COLLECT + "); the speed monitor "
    "averages a 10-batch window (speed_monitor window_size 10 in the yamls) and "
    "submit_benchmarks runs max_duration '30ba' (" + SUBMIT + ", an older version). "
    "Not stated: warm-up steps excluded, torch/Composer versions of each table (the "
    "stored sweep.sh pins llm-foundry v0.0.4 and mosaicml/pytorch:2.0.1_cu118, " + SWEEP
)
AC_FULL = {
    "mode": "full",
    "policy": "every MPTBlock wrapped (activation_checkpointing_fn returns "
    "isinstance(module, MPTBlock), " + MPT_MODEL + "); non-reentrant "
    "(activation_checkpointing_reentrant False in every yaml and in " + SUBMIT + ")",
}
MP_NOTE = (
    "'amp_bf16' = torch.autocast bf16 matmuls over fp32 weights; FSDP mixed_precision "
    "'PURE' gathers bf16 params and reduce-scatters bf16 grads. 'DEFAULT' differs "
    "between Composer versions: param bf16 with reduce_dtype unset (so FSDP reduces in "
    "bf16) in "
    + COMPOSER_MP
    + " (the torch 2.0.1 era), param bf16 with reduce fp32 in "
    "later versions; which Composer ran each table is not stated, so reduce_dtype is "
    "None for DEFAULT rows. 'bf16' (A100 40GB table, A100 80GB 70b rows) is Composer's "
    "older precision name; what it cast is not checked here"
)
NET_NODE = (
    "The A100 tables are headed 'with 1600 Gbps node-node interconnect (RoCE)': "
    "1600 Gb/s per node; 8 GPUs per node is not stated (assumed: 200 Gb/s per GPU, "
    "ib-200g's line rate, though RoCE, not InfiniBand)"
)
ATTENTION = (
    "not stated in the table: attn_impl 'triton' (MPT's Triton flash attention) in the "
    "yamls and submit_benchmarks' default; the 13b yaml read says 'flash'"
)


def _run(row: str) -> dict:
    """One run from one table row: 'gpu-key|<the row as the README writes it>'."""
    gpu, quote = row.split("|", 1)
    quote = "|" + quote
    f = [cell.strip() for cell in quote.strip("|").split("|")]
    size, seq, gpus, mb, accum = f[0], int(f[1]), int(f[2]), int(f[7]), int(f[8])
    ac, pure = f[17] == "True", f[15] == "PURE"
    n_layer, d_model, n_head = SHAPES[size]
    one_node = gpus <= 8
    if gpu == "h100-sxm":
        network = None
        net_note = "The H100 table ('H100 80GB BF16') names no interconnect"
    else:
        network = None if one_node else "ib-200g"
        net_note = NET_NODE
    if one_node:
        net_note += "; 8 GPUs read as one node, all traffic NVLink (assumed)"
    return {
        "name": f"llmfoundry-mpt-{size}-{gpu}-{gpus}gpu-s{seq}" + ("-ac" * ac),
        "title": f"llm-foundry MPT-{size}, seq {seq}, FSDP FULL_SHARD on {gpus} {gpu}",
        "source": README,
        "quote": quote,
        "model": {
            "n_layer": n_layer,
            "d_model": d_model,
            "n_head": n_head,
            "n_kv_head": n_head,  # multi-head attention, no GQA
            "ffn_hidden": 4 * d_model,  # expansion_ratio 4
            "ffn_kind": "gelu",
            "vocab_size": 50368,
            "seq_len": seq,
            "tied_embeddings": True,
            # beyond the other runs' schema: what makes N match NumParams
            "learned_pos_emb": True,  # a max_seq_len x d_model table
            "linear_bias": True,
            "norm": "LayerNorm, weight and bias",
            "model_source": MODEL_SOURCE,
        },
        "gpu": gpu,
        "gpus": gpus,
        "gpus_per_node": None,  # not stated
        "network": network,
        "network_note": net_note,
        "plan": {
            # torch FSDP (FullyShardedDataParallel, not fully_shard) FULL_SHARD:
            # params, grads and optimizer state sharded over all GPUs
            "strategy": "fsdp2",
            "fsdp_api": "FSDP1 FULL_SHARD, limit_all_gathers True (" + SUBMIT + ")",
            "micro_batch": mb,
            "accum_steps": accum,
            "ac": AC_FULL if ac else {"mode": "none"},
            "param_dtype": "bfloat16",
            "reduce_dtype": "bfloat16" if pure else None,  # MP_NOTE
            "precision": f"{f[14]} / FSDP mixed_precision {f[15]}",
            "compile": False,  # no compile_config in the yamls or submit_benchmarks
            "float8": False,
            "attention": ATTENTION,
            "optimizer": "DecoupledAdamW (decoupled_adamw in the yamls)",
        },
        "published": {
            "tokens_per_s_per_gpu": int(f[12]),
            "mfu": float(f[4]) / 100,
            "hfu": float(f[5]) / 100,
            "memory_bytes_per_gpu": None,  # the tables give no memory figure
            "n_params": int(f[19]),
            "mfu_flops_convention": MFU_CONVENTION,
        },
        "notes": (
            f"Global batch {f[9]} sequences ({f[13]} tokens) = {mb} x {accum} "
            f"accumulation steps x {gpus} GPUs. "
            + THROUGHPUT_NOTE
            + ". "
            + MP_NOTE
            + ". The 'Model TFLOP' column is not used: the A100 40GB header lacks it "
            "though its rows carry a value, and rows in bf16/PURE read 100x MFU x peak."
        ),
    }


# 'gpu key|table row'. Chosen to span GPU kinds, sizes 125m-70b, 8-128 GPUs, AC on
# and off; seq 2048 where the table has it (two 4096 rows with AC).
ROWS = [
    "a100-80gb|  125m | 2048 | 8 | a100_80gb | 44.45 | 44.45 | "
    " 1.386706E+14 | 32 | 2 | 512 | 553 | 1133901 | 141737 | "
    "1048576 | amp_bf16 | DEFAULT | FULL_SHARD | False | False | "
    "125311488 |",
    "a100-80gb|  350m | 2048 | 8 | a100_80gb | 51.62 | 51.62 | "
    " 1.610589E+14 | 32 | 2 | 512 | 229 | 470263 | 58782 | 1048576 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 355985408 |",
    "a100-80gb|  760m | 2048 | 8 | a100_80gb | 56.85 | 56.85 | "
    " 1.773749E+14 | 24 | 2 | 384 | 126 | 259472 | 32434 | 786432 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 760470528 |",
    "a100-80gb|  1b | 2048 | 8 | a100_80gb | 59.86 | 59.86 | "
    " 1.867501E+14 | 14 | 4 | 448 | 80 | 164109 | 20513 | 917504 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 1315950592 |",
    "a100-80gb|  3b | 2048 | 8 | a100_80gb | 62.11 | 62.11 | "
    " 1.937863E+14 | 10 | 2 | 160 | 42 | 86491 | 10811 | 327680 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 2651837440 |",
    "a100-80gb|  7b | 2048 | 8 | a100_80gb | 64.23 | 64.23 | "
    " 2.003836E+14 | 6 | 2 | 96 | 18 | 37130 | 4641 | 196608 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 6658859008 |",
    "a100-80gb|  7b | 4096 | 8 | a100_80gb | 54.84 | 73.12 | "
    " 1.711072E+14 | 16 | 2 | 256 | 7 | 29472 | 3684 | 1048576 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | True | False | 6667247616 |",
    "a100-80gb|  13b | 2048 | 8 | a100_80gb | 59.57 | 59.57 | "
    " 1.858556E+14 | 2 | 3 | 48 | 8 | 18097 | 2262 | 98304 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 12853954560 |",
    "a100-80gb|  13b | 4096 | 8 | a100_80gb | 57.62 | 76.82 | "
    " 1.797680E+14 | 10 | 3 | 240 | 4 | 16482 | 2060 | 983040 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | True | False | 12864440320 |",
    "a100-80gb|  30b | 2048 | 8 | a100_80gb | 55.3 | 73.74 | "
    " 1.725420E+14 | 3 | 21 | 504 | 3 | 7330 | 916 | 1032192 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | True | False | 29975214080 |",
    "a100-80gb|  70b | 2048 | 64 | a100_80gb | 53.33 | 71.1 | "
    "1.663896E+16 | 8 | 4 | 2048 | 12 | 26274 | 410 | 4194304 | "
    "bf16 | PURE | FULL_SHARD | True | False | 64862437376 |",
    "a100-40gb|  760m | 2048 | 8 | a100_40gb | 52.89 | 52.89 | "
    " 1.650168E+16 | 12 | 4 | 384 | 117 | 241389 | 30173 | 786432 | "
    "bf16 | PURE | FULL_SHARD | False | False | 760470528 |",
    "a100-40gb|  1b | 2048 | 64 | a100_40gb | 55.44 | 55.44 | "
    " 1.729728E+16 | 10 | 1 | 640 | 593 | 1216104 | 19001 | "
    "1310720 | bf16 | PURE | FULL_SHARD | False | False | "
    "1315950592 |",
    "a100-40gb|  7b | 2048 | 32 | a100_40gb | 51.55 | 68.73 | "
    " 1.608360E+16 | 18 | 1 | 576 | 58 | 119202 | 3725 | 1179648 | "
    "bf16 | PURE | FULL_SHARD | True | False | 6658859008 |",
    "a100-40gb|  13b | 2048 | 128 | a100_40gb | 51.93 | 69.24 | "
    " 1.620216E+16 | 16 | 1 | 2048 | 123 | 252444 | 1972 | 4194304 | "
    "bf16 | PURE | FULL_SHARD | True | False | 12853954560 |",
    "h100-sxm|  1b | 2048 | 8 | h100_80gb | 41.82 | 41.82 | "
    " 4.138134E+14 | 14 | 1 | 112 | 177 | 363645 | 45455 | 229376 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 1315950592 |",
    "h100-sxm|  7b | 2048 | 8 | h100_80gb | 46.44 | 46.44 | "
    " 4.595096E+14 | 6 | 1 | 48 | 41 | 85144 | 10643 | 98304 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 6658859008 |",
    "h100-sxm|  13b | 2048 | 64 | h100_80gb | 39.86 | 39.86 | "
    " 3.943653E+14 | 2 | 1 | 128 | 150 | 307209 | 4800 | 262144 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | False | False | 12853954560 |",
    "h100-sxm|  30b | 2048 | 8 | h100_80gb | 38.11 | 50.82 | "
    " 3.771361E+14 | 3 | 21 | 504 | 7 | 16022 | 2002 | 1032192 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | True | False | 29975214080 |",
    "h100-sxm|  70b | 2048 | 64 | h100_80gb | 42.57 | 56.76 | "
    " 4.212583E+14 | 8 | 4 | 2048 | 32 | 66523 | 1039 | 4194304 | "
    "amp_bf16 | DEFAULT | FULL_SHARD | True | False | 64862437376 |",
]
RUNS = [_run(row) for row in ROWS]
RUNS_BY_NAME = {run["name"]: run for run in RUNS}
