"""IBM's fms-fsdp throughput table: Llama 2 7B-70B pre-training with torch FSDP (HSDP
for 7B/13B, FULL_SHARD for 34B/70B) on 128 A100 GPUs, quoted row by row.

    from distlab.planner.runs.fms_fsdp import RUNS
    [(run["name"], run["published"]["tokens_per_s_per_gpu"]) for run in RUNS]

The table states model size, hardware, sharding, activation checkpointing, batch size
(per GPU) and tokens/s per GPU; nothing else. Sequence length, precision, model shapes
and node size come from the repository's code of the same period (each cited), not from
the table. No memory, no MFU, no network. The companion blog (PyTorch/IBM, 'Maximizing
training throughput using PyTorch FSDP') has a larger table that could not be read with
the search tools; only its first paragraph is quoted (7B row notes).
"""

from __future__ import annotations

FMS = "https://github.com/foundation-model-stack/fms-fsdp/blob/"
README = FMS + "0d319983c4b3b7f7b3b5e2c5e7f746746b6f73a9/README.md"
# The 'pretraining/' package the README of that period points to (docs/configurations.md
# links ../pretraining/config/training.py)
TRAIN_CONFIG = (
    FMS + "240a2748a647139f616aeaa83b631dfffe67a2ac/pretraining/config/training.py"
)
MODEL_CONFIG = FMS + (
    "7c926a1906428a735f9b72466fde5b29542758f1/pretraining/utils/config_utils.py"
)
LATER_MODEL_CONFIG = FMS + (
    "08d8ae7f5c75ecd255e21a53b573219c73602866/fms_fsdp/utils/config_utils.py"
)
TRAIN_UTILS = FMS + (
    "27e655d4e8d7cd29ed57a0a8f77d52118bc3a52d/pretraining/utils/train_utils.py"
)
MIXED = FMS + (
    "2e76f9919bed17583745f6cbb634394a0f96bad1/pretraining/policies/mixed_precision.py"
)
AC_HANDLER = FMS + (
    "27e655d4e8d7cd29ed57a0a8f77d52118bc3a52d/pretraining/policies/ac_handler.py"
)
SCRIPTS = FMS + "2fdced7686cbb6da145366eacb27ff85ae09585a/scripts/70b.sh (and 34b.sh)"
FMS_LLAMA = (
    "https://github.com/foundation-model-stack/foundation-model-stack/blob/"
    "00b9af6305656b97003d6c14529457b401db8bc6/fms/models/llama.py"
)
IBM_BLOG = "https://research.ibm.com/blog/pytorch-fsdp"

# The table's columns (header padding removed; each quote is one row, verbatim)
COLUMNS = (
    "Model Size | Hardware | Sharding Strategy | Activation Checkpointing | Batch Size "
    "| Training Throughput <br/> (128 GPUs) | Profile Trace"
)
NETWORK_NOTE = (
    "Not stated in the table or README. The launch scripts (" + SCRIPTS + ") put "
    "/opt/amazon/efa and aws-ofi-nccl on LD_LIBRARY_PATH and set "
    "FI_EFA_SET_CUDA_SYNC_MEMOPS=0, which suggests AWS EFA, but they set batch_size=5, "
    "not the table's 8 / 6, so they are not the table's runs"
)
PLAN = {
    # bfSixteen (param, reduce and buffer dtype bf16, MIXED) when mixed_precision is
    # True, its default (TRAIN_CONFIG; get_policies in TRAIN_UTILS)
    "param_dtype": "bfloat16",
    "reduce_dtype": "bfloat16",
    "fsdp_api": "FSDP1 (FullyShardedDataParallel); FULL_SHARD or HYBRID_SHARD",
    "accum_steps": 1,  # the train loop steps after every batch (TRAIN_UTILS)
    "compile": False,  # use_torch_compile default False; the scripts set False
    "float8": False,
    # README: 'SDPA implementation of Flash attention v2'
    "attention": "F.scaled_dot_product_attention (flash v2 backend)",
    "optimizer": "AdamW (not checked in the code read here)",
}
AC_FULL = {
    "mode": "full",
    "policy": "selective_checkpointing=1: every LLaMABlock wrapped by a non-reentrant "
    "checkpoint_wrapper (count % 1 == 0, " + AC_HANDLER + ")",
}
NOTES = (
    "Sequence length 4096 is train_config's seq_length default (" + TRAIN_CONFIG + ") "
    "and the README's '4k context length' for its 7B run; the table gives none. "
    "Tokens/s: the loop prints 'overall token per gpu per sec' = tokens since start / "
    "world size / wall time since start (" + TRAIN_UTILS + "); the table does not say "
    "which print it quotes. 'A100' without memory size: a100-80gb is assumed, the bf16 "
    "peak (312 TFLOPS) is the same for 40 and 80 GB. gpus_per_node 8 from the scripts' "
    "--nproc_per_node=8 and docs' '128 * 8 = 1024 total gpus' example. "
)


def _llama2(n_layer, d_model, n_head, n_kv_head, ffn_hidden):
    return {
        "n_layer": n_layer,
        "d_model": d_model,
        "n_head": n_head,
        "n_kv_head": n_kv_head,
        # hidden_grow_factor = ffn_hidden / d_model, multiple_of=1 (MODEL_CONFIG)
        "ffn_hidden": ffn_hidden,
        "ffn_kind": "swiglu",  # GatedLinearUnit, activation silu (FMS_LLAMA)
        "vocab_size": 32000,  # src_vocab_size=32000 (MODEL_CONFIG)
        "seq_len": 4096,
        "tied_embeddings": False,  # tie_heads default False (FMS_LLAMA)
        "model_source": MODEL_CONFIG + " ; " + FMS_LLAMA + " (RMSNorm: "
        "LayerNormParameterized use_mean=False, scale only; no biases; RoPE)",
    }


KV_NOTE = (
    "n_kv_head uncertain: the config of the README's period (MODEL_CONFIG) sets no "
    "kvheads for 34b/70b, and fms LLaMAConfig's kvheads=0 means kvheads = nheads "
    "(multi-head, recorded here); the later " + LATER_MODEL_CONFIG + " sets kvheads=8 "
    "(Llama 2's GQA). Which one ran the table is not stated; GQA would cut N by about "
    "12% for 70b. "
)


def _run(size, model, strategy, ac, batch, tps, row, notes=""):
    return {
        "name": f"fms-fsdp-llama2-{size}-128xa100-{strategy}",
        "title": f"fms-fsdp Llama 2 {size.upper()}: {strategy.upper()} on 128 A100",
        "source": README,
        "quote": row,
        "model": model,
        "gpu": "a100-80gb",  # 'A100' only; see NOTES
        "gpus": 128,
        "gpus_per_node": 8,
        "network": None,
        "network_note": NETWORK_NOTE,
        "plan": {
            **PLAN,
            # hsdp: shard within sharding_group_size=8 GPUs, replicate across the 16
            # groups (TRAIN_CONFIG default 8)
            "strategy": strategy,
            "shard_group": 8 if strategy == "hsdp" else 128,
            "micro_batch": batch,
            "ac": ac,
        },
        "published": {
            "tokens_per_s_per_gpu": tps,
            "mfu": None,  # not in the table
            "memory_bytes_per_gpu": None,  # not in the table
            "mfu_flops_convention": None,
        },
        "notes": "Columns: " + COLUMNS + ". " + NOTES + notes,
    }


RUNS = [
    _run(
        "7b",
        _llama2(32, 4096, 32, 32, 11008),
        "hsdp",
        {"mode": "none"},
        2,
        3760,
        "| 7b         | 128 * A100  | HSDP              | False                    "
        "| 2          | **3760 token/gpu/sec**               | [7b trace](https://"
        "ibm.box.com/s/ohaliqku0rl52jc9dhw1cb04opgssgy3)    |",
        "The blog (" + IBM_BLOG + ", 13 Mar 2024) opens: 'a rapid training speed of "
        "3,700 tokens/sec/GPU, or 40B tokens/day on 128 A100 GPUs. This translates to "
        "a model FLOPS utilization (MFU) and hardware FLOPS utilization (HFU) of 57%'; "
        "it credits 'selective activation checkpointing', which this row (AC False) "
        "does not use. The README's own 7B training: 'an efficiency of 3500 "
        "tokens/sec/GPU'.",
    ),
    _run(
        "13b",
        _llama2(40, 5120, 40, 40, 13824),
        "hsdp",
        {"mode": "none"},
        1,
        1700,
        "| 13b        | 128 * A100  | HSDP              | False                    "
        "| 1          | **1700 token/gpu/sec**               | [13b trace](https://"
        "ibm.box.com/s/2j0uib7m1p5wqjhv9dagq4331n62iyv6)   |",
    ),
    _run(
        "34b",
        _llama2(48, 8192, 64, 64, 22016),
        "fsdp2",
        AC_FULL,
        8,
        772,
        "| 34b        | 128 * A100  | FSDP              | True                     "
        "| 8          | **772 token/gpu/sec**                | [34b trace](https://"
        "ibm.box.com/s/tf7x6254egzgzrn6ceh6kgdgy0rbowz6)   |  ",
        KV_NOTE,
    ),
    _run(
        "70b",
        _llama2(80, 8192, 64, 64, 28672),
        "fsdp2",
        AC_FULL,
        6,
        380,
        "| 70b        | 128 * A100  | FSDP              | True                     "
        "| 6          | **380 token/gpu/sec**                | [70b trace](https://"
        "ibm.box.com/s/5o1ohr1144nloqjrelsvunrq0rutyynu)   |",
        KV_NOTE,
    ),
]
RUNS_BY_NAME = {run["name"]: run for run in RUNS}
