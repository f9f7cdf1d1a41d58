"""torchtitan's FSDP2 runs on 64 A100s: what each states, quoted, and what it leaves
out.

    from distlab.planner.runs.torchtitan_a100 import RUNS
    [run["published"]["tokens_per_s_per_gpu"] for run in RUNS]

Every run is data parallel only (FSDP2 or ZeRO-1, no tensor or pipeline parallel). A
number here is quoted from the source named beside it, or derived from quoted numbers
with the arithmetic shown in ``notes``; None means the source does not state it. GPU and
network keys refer to ``distlab.planner.hardware``.
"""

from __future__ import annotations

GH = "https://github.com/"
TT = GH + "pytorch/torchtitan/blob/"
# The 64-A100 table. Three versions of docs/performance.md were read: this one (Llama 3
# + Llama 2 tables), a later one that adds a Llama 3.1 405B / 128 H100 table above it
# with the SAME A100 rows, and an earlier one with older A100 rows (see OLDER_TT_ROWS).
# Only this version's commit could be retrieved; the newest version of the file (commit
# eaea6f6a) replaced all of it with H100 tables.
TT_DOC = TT + "041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md"
# torchtitan config and code of that period (one consistent commit for the toml,
# defaults and metrics code):
TT_COMMIT = TT + "0011fb905e9561a51af0f265e35d989f7448b1d8/"
TT_8B_TOML = TT_COMMIT + "train_configs/llama3_8b.toml"
TT_DEFAULTS = TT_COMMIT + "torchtitan/config_manager.py"
TT_70B_TOML = (
    TT + "08e537949f497065e497c88a1797a14a57678239/train_configs/llama3_70b.toml"
)
TT_AC = TT + (
    "004b3148a92b565ef0ce7a7bcc61e0159c7ec930/"
    "torchtitan/parallelisms/parallelize_llama.py"
)
# the model code: a main-branch version of the file (no MoE, the block of the runs' era;
# the FFN width formula is the same in every version read). An earlier citation,
# @0199cbc1, was an experimental branch with MoE on by default.
TT_FFN = (
    TT + "6d74b81c7179f2ae06f54ec0d212b606a47e2257/torchtitan/models/llama/model.py"
)
TT_TRAIN_OLD = TT + "5604ab163deb5ee50b051bf148e4bc514c08dfdb/train.py"
TT_TRAIN_NEW = TT_COMMIT + "train.py"
META_ARGS = GH + (
    "meta-llama/llama-models/blob/084b88e939e954d2851ee28f96398ca54aa8f8f9/"
    "models/sku_list.py"
)
OLDER_TT_ROWS = (
    "8B selective layer 2876 WPS 56.3%; 8B selective op 2973 / 58.2%; 70B full 323 "
    "/ 50.5%"
)

TT_MFU = (
    "WPS = tokens / (seconds * model_parallel_size) per GPU; MFU = "
    "flops_per_token * WPS / peak, peak 312e12 for "
    "A100 (utils.get_peak_flops). flops_per_token = 6*N + 12*L*H*Q*T (Q = head "
    "dim, T = seq_len; attention NOT "
    "halved for causal, FA's recompute not counted). N at the time of the table "
    "= ALL parameters, embedding "
    "included ("
    + TT_TRAIN_OLD
    + " passes get_num_params(model)); the later "
    + TT_TRAIN_NEW
    + " excludes the "
    "token embedding. Check: 6*8.030e9 + 12*32*32*128*8192 = 61.07e9 "
    "FLOP/token; x 2904 / 312e12 = 56.8%, x 2973 "
    "= 58.2%; 70B: (6*70.55e9 + 12*80*64*128*8192) x 331 / 312e12 = 51.7%: all "
    "three rows match with the "
    "embedding included (with it excluded they would read 53.9%, 55.2%, 51.1%)"
)
TT_NETWORK_NOTE = (
    "Not stated: the doc names only '64 A100 (80GB)' GPUs; no node size, NVLink "
    "or NIC, nor whose cluster. "
    "8 GPUs per node is the HGX A100 norm, an assumption here, not a statement"
)
TT_PLAN = {
    # 'FSDP2 (1D parallelism)'; data_parallel_shard_degree = -1 (all ranks)
    "strategy": "fsdp2",
    "micro_batch": 1,  # 'local batch size 1 (global batch size = ... 64)'
    # torchtitan had no gradient accumulation then; one forward/backward per step
    "accum_steps": 1,
    "param_dtype": "bfloat16",  # default --training.mixed_precision_param (TT_DEFAULTS)
    # default --training.mixed_precision_reduce, choices=['float32'] (TT_DEFAULTS)
    "reduce_dtype": "float32",
    # apply_fsdp (TT_AC)
    "reshard_after_forward": "every block but the last; root not resharded",
    # 'compile = false' in both tomls; the doc does not mention compile
    "compile": False,
    "float8": False,  # '[float8] enable_float8_linear = false' in both tomls
    "attention": "F.scaled_dot_product_attention(is_causal=True)",  # TT_FFN
    # AdamW per the tomls. fp32 shards and fp32 Adam states follow from FSDP2 keeping
    # each shard in the dtype the model was built in (fp32 by default) and casting to
    # param_dtype only when gathering: torch behaviour, not something the doc states.
    "optimizer": "AdamW",
}
SELECTIVE_OP = (
    "per transformer block: save the outputs of aten.mm (except every second "
    "mm), of SDPA flash/efficient "
    "attention and of reduce_scatter; recompute the rest (_save_list, " + TT_AC + ")"
)


def _llama3(n_layer, d_model, n_head, ffn_hidden, seq_len):
    return {
        "n_layer": n_layer,
        "d_model": d_model,
        "n_head": n_head,
        "n_kv_head": 8,
        # ffn_hidden: int(2*4*d/3), times ffn_dim_multiplier 1.3, rounded up to
        # multiple_of (FeedForward, TT_FFN)
        "ffn_hidden": ffn_hidden,
        "ffn_kind": "swiglu",
        # VOCAB_SIZE in META_ARGS; torchtitan takes it from the tokenizer (n_words)
        "vocab_size": 128256,
        "seq_len": seq_len,
        # separate tok_embeddings and output modules (TP plan in TT_AC)
        "tied_embeddings": False,
        "model_source": META_ARGS
        + " (dim, n_layers, n_heads, n_kv_heads, 1.3, multiple_of) ; "
        + TT_FFN,
    }


# multiple_of 1024; seq_len 8192 in TT_8B_TOML
LLAMA3_8B = _llama3(32, 4096, 32, 14336, 8192)
# multiple_of 4096; seq_len 8192 in TT_70B_TOML
LLAMA3_70B = _llama3(80, 8192, 64, 28672, 8192)


def _torchtitan(name, model, ac, wps, mfu, quote, notes):
    return {
        "name": name,
        "title": f"torchtitan {name.split('-', 1)[1]}: FSDP2 on 64 A100 80GB",
        "source": TT_DOC,
        "quote": quote,
        "model": model,
        "gpu": "a100-80gb",
        "gpus": 64,
        "gpus_per_node": None,  # not stated
        "network": None,
        "network_note": TT_NETWORK_NOTE,
        "plan": {**TT_PLAN, "ac": ac},
        "published": {
            "tokens_per_s_per_gpu": wps,
            "mfu": mfu,
            "memory_bytes_per_gpu": None,  # the doc gives no memory figure
            "mfu_flops_convention": TT_MFU,
        },
        "notes": notes,
    }


LAYER_NOTE = (
    "Not stated: which layer frequency. The 8B toml sets selective_ac_option = "
    "'op', so this row overrode it; "
    "the default is '2' ('checkpoint every other layer', TT_DEFAULTS), assumed "
    "here. Every ac_freq-th block is "
    "wrapped in full checkpointing, the others keep all activations. Older "
    "version of the doc: "
)
RUNS = [
    _torchtitan(
        "torchtitan-llama3-8b-sel-layer",
        LLAMA3_8B,
        {"mode": "selective-layer", "frequency": 2},
        2904,
        0.568,
        "| 8B | 1 | selective layer | 2904 | 56.8% |",
        LAYER_NOTE
        + OLDER_TT_ROWS
        + ". Not stated: torch version, data loader overlap, warm-up steps skipped.",
    ),
    _torchtitan(
        "torchtitan-llama3-8b-sel-op",
        LLAMA3_8B,
        {"mode": "selective-op", "policy": SELECTIVE_OP},
        2973,
        0.582,
        "| 8B | 1 | selective op | 2973 | 58.2% |",
        "The 8B toml's own setting (mode 'selective', selective_ac_option "
        "'op'); the doc's loss curves use it too. "
        "Same figures in the older doc. Not stated: torch version.",
    ),
    _torchtitan(
        "torchtitan-llama3-70b-full",
        LLAMA3_70B,
        {"mode": "full"},
        331,
        0.517,
        "| 70B | 1 | full | 331 | 51.7% |",
        "Full AC: every block wrapped by checkpoint_wrapper, only block inputs "
        "kept. The stored 70B toml sets "
        "tensor_parallel_degree = 8 and batch_size = 8 (its 2D default); the "
        "doc's 1D row uses FSDP only and local "
        "batch 1, so those were overridden; seq_len 8192, mode 'full', compile "
        "false come from that toml. Older doc: "
        "323 WPS / 50.5%, with a footnote that on 128 A100 the 70B MFU 'can go "
        "up to 50.9%'.",
    ),
]
