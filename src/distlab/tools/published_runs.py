"""Published training runs the planner is checked against: what each states, quoted, and
what it leaves out.

    from distlab.tools.published_runs import PUBLISHED_RUNS
    [run["published"]["tokens_per_s_per_gpu"] for run in PUBLISHED_RUNS]

Every run is data parallel only (FSDP2 or ZeRO-1, no tensor or pipeline parallel). A
number here is quoted from the source named beside it, or derived from quoted numbers
with the arithmetic shown in ``notes``; None means the source does not state it. GPU and
network keys refer to ``distlab.tools.hardware``.
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
TT_FFN = (
    TT + "0199cbc1ba671c15df501fd9aa8bb68afd4352fd/torchtitan/models/llama/model.py"
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
PUBLISHED_RUNS = [
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

LLMC = GH + "karpathy/llm.c/blob/"
LLMC_124M = LLMC + "039904ee9fb925be226116d08b0e4c73e6518b7e/scripts/run_gpt2_124M.sh"
LLMC_1558M = LLMC + "039904ee9fb925be226116d08b0e4c73e6518b7e/scripts/run_gpt2_1558M.sh"
LLMC_TRAIN = LLMC + "00247dca9b66a5bc6092bf0ab133100e0d52f71b/train_gpt2.cu"
LLMC_MFU_H = LLMC + "0e69e3ae466694915e9f7e5742b3c55edacc20fd/llmc/mfu.h"
LLMC_MFU = (
    "gpt2_estimate_mfu ("
    + LLMC_TRAIN
    + "): flops_per_token = 6*N + 6*L*C*T, N = ALL parameters (tied token "
    "embedding, position embedding, LayerNorms and biases included), T = "
    "seq_len; 6*L*C*T is half of torchtitan's "
    "12*L*H*Q*T. Peak from get_flops_promised ("
    + LLMC_MFU_H
    + "): A100-SXM4-80GB 312 TFLOPS; 'NVIDIA H100 80GB "
    "HBM3' 756 * 528/456 * 1830/1620 = 988.8 TFLOPS (bf16 with fp32 accumulate)"
)
LLMC_PLAN = {
    # -z 1: AdamW m, v and fp32 master weights sharded; bf16 params and grads replicated
    "strategy": "zero1",
    # -r 0: no recompute (the flag's default is 1, recompute GeLU)
    "ac": {"mode": "none"},
    # floatX, llm.c's default precision mode; fp32 master weights (-w default 1)
    "param_dtype": "bfloat16",
    # gradients are floatX: 1,557,686,400 params -> '2971 MiB for parameter gradients'
    "reduce_dtype": "bfloat16",
    "compile": None,  # C/CUDA, no torch.compile; kernels are hand-written and fused
    "float8": False,
    "attention": "cuDNN flash attention (make train_gpt2cu USE_CUDNN=1)",
    "optimizer": "AdamW",
}


def _gpt2(n_layer, d_model, n_head):
    return {
        "n_layer": n_layer,
        "d_model": d_model,
        "n_head": n_head,
        "n_kv_head": n_head,
        "ffn_hidden": 4 * d_model,  # fcw is 4*C x C (train_gpt2.cu)
        "ffn_kind": "gelu",
        # padded to 50304 for the matmuls (padded_vocab_size, 'padded to 128')
        "vocab_size": 50257,
        "seq_len": 1024,  # -t 1024
        "tied_embeddings": True,  # the classifier matmul uses params.wte
        "model_source": LLMC_TRAIN
        + " (depth table: d12 -> 768 channels, 12 heads; d48 -> 1600, 25)",
    }


PUBLISHED_RUNS += [
    {
        "name": "llmc-gpt2-124m-8xa100",
        "title": "llm.c GPT-2 (124M) reproduction on one 8x A100 80GB SXM node",
        "source": LLMC_124M,
        "quote": "# on 8X A100 80GB SXM ($14/hr) steps in ~300ms/iter",
        "model": _gpt2(12, 768, 12),
        "gpu": "a100-80gb",
        "gpus": 8,
        "gpus_per_node": 8,
        "network": "nvlink-a100",
        "network_note": (
            "One node: all traffic over NVLink; the script names the node, not its "
            "interconnect."
        ),
        "plan": {**LLMC_PLAN, "micro_batch": 64, "accum_steps": 1, "gelu_fusion": 0},
        "published": {
            "tokens_per_s_per_gpu": 524288 / 0.300 / 8,  # derived: 218,453
            "mfu": None,  # not stated in the script
            "memory_bytes_per_gpu": None,
            "mfu_flops_convention": LLMC_MFU,
        },
        "notes": (
            "Derived: -d 524288 tokens per step / ~0.300 s / 8 GPUs = 218,453 "
            "tokens/s per GPU; '~300ms' is a "
            "rounded comment. -b 64 -t 1024 on 8 GPUs = 524,288 tokens, so no "
            "accumulation. -ge not given: default "
            "'2 for >=SM90, 0 for older GPUs' -> 0 on A100. The run's write-up "
            "(github.com/karpathy/llm.c/discussions"
            "/481) was not readable with the search tools, so its own tok/s and "
            "MFU are not used."
        ),
    },
    {
        "name": "llmc-gpt2-1558m-8xh100",
        "title": "llm.c GPT-2 (1558M) reproduction on one 8x H100 80GB SXM node",
        "source": LLMC_1558M,
        "quote": "# on 8X H100 80GB SXM ($28/hr) steps in 2.80s/iter",
        "model": _gpt2(48, 1600, 25),
        "gpu": "h100-sxm",
        "gpus": 8,
        "gpus_per_node": 8,
        "network": "nvlink-h100",
        "network_note": (
            "One node: all traffic over NVLink; the script names the node, not its "
            "interconnect."
        ),
        "plan": {**LLMC_PLAN, "micro_batch": 16, "accum_steps": 8, "gelu_fusion": 1},
        "published": {
            "tokens_per_s_per_gpu": 1048576 / 2.80 / 8,  # derived: 46,811
            "mfu": None,  # not in the script; see notes for the log's 47.3%
            "memory_bytes_per_gpu": None,
            "mfu_flops_convention": LLMC_MFU,
            # llm.c's own allocation log (MiB), not a measured peak: no CUDA context,
            # cuBLAS/cuDNN workspace, NCCL
            "allocations_mib": {
                "params": 2971,
                "grads": 2971,
                "adam_m": 742,
                "adam_v": 742,
                "master": 742,
                "activations": 40409,
            },
        },
        "notes": (
            "Derived: -d 1048576 tokens / 2.80 s / 8 GPUs = 46,811 tokens/s per "
            "GPU; -b 16 -t 1024 x 8 GPUs = "
            "131,072 tokens per micro-step, so 8 accumulation steps. The run's "
            "log, posted in "
            "github.com/karpathy/llm.c/discussions/677, was read only as a "
            "verbatim copy quoted in a third-party "
            "blog post (the discussion itself is not in the search corpora): "
            "'batch_size B=16 * seq_len T=1024 * "
            "num_processes=8 and total_batch_size=1048576 => setting "
            "grad_accum_steps=8', steady steps "
            "'2749.40 ms | 47.3% bf16 MFU | 381369 tok/s' (47,671 per GPU), and "
            "the allocations above "
            "(activations 40409 MiB with -r 0). Treat those as secondary; the "
            "script's 2.80 s is primary."
        ),
    },
]
RUNS_BY_NAME = {run["name"]: run for run in PUBLISHED_RUNS}
