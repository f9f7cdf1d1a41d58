"""llm.c's GPT-2 reproductions (C/CUDA, ZeRO-1): what each script states, quoted.

from distlab.planner.runs.llmc import RUNS
"""

from __future__ import annotations

GH = "https://github.com/"

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


RUNS = [
    {
        "name": "llmc-gpt2-124m-8xa100",
        "title": "llm.c GPT-2 (124M) reproduction on one 8x A100 80GB SXM node",
        "source": LLMC_124M,
        "quote": "# on 8X A100 80GB SXM ($14/hr) steps in ~300ms/iter",
        "model": _gpt2(12, 768, 12),
        "gpu": "a100-80gb",
        "gpus": 8,
        "gpus_per_node": 8,
        "network": None,
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
        "network": None,
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
