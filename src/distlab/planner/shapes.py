"""Model shapes for the planner: what a transformer's size, FLOPs and activation bytes
depend on.

    shape = SHAPES["llama3-8b"]
    # 8,030,261,248, Meta's count
    shape.n_params()
    # the book's 6N + 12*L*C*T
    shape.flops_per_token(8192)
    # the block's matmul weights
    shape.block_matmul_params()

Two families: GPT-2 (the book's own model: LayerNorm, GELU MLP of width 4C, biases,
learned positions, the head tied to the embedding) and Llama 3 (RMSNorm, SwiGLU MLP,
rotary positions, grouped-query attention with fewer key/value heads, no biases, an
untied head). A shape holds only sizes, so a 70B model is planned without allocating it;
for the book's own presets the counts here are tested equal to ``distlab.model`` and
``distlab.memory``'s exact formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.costs.flops import training_flops_per_token
from distlab.model import GPTConfig, preset


@dataclass(frozen=True)
class ModelShape:
    name: str
    label: str
    n_layer: int
    d_model: int  # C, the residual stream's width
    n_head: int
    n_kv_head: int  # = n_head without grouped-query attention
    ffn_hidden: int  # the MLP's inner width: 4C for GPT-2, 14336 for Llama 3 8B
    vocab_size: int
    # the longest context (GPT-2's learned positions have one row per position)
    max_seq_len: int
    family: str  # "gpt2" or "llama"
    source: str

    @property
    def gpt2(self) -> bool:
        return self.family == "gpt2"

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * (self.d_model // self.n_head)

    # --- begin parameters ---
    def block_matmul_params(self) -> int:
        """Weights that multiply activations in one block: q, k, v and the output
        projection, then the MLP's two matrices (GELU) or three (SwiGLU: gate,
        up, down)."""
        C, kv, F = self.d_model, self.kv_dim, self.ffn_hidden
        return C * (C + 2 * kv) + C * C + (2 if self.gpt2 else 3) * C * F

    def block_params(self) -> int:
        """All of one block's parameters: its matmul weights, their biases (GPT-2) and
        two norms (LayerNorm: weight and bias; RMSNorm: weight only)."""
        C, kv, F = self.d_model, self.kv_dim, self.ffn_hidden
        biases = (C + 2 * kv) + C + F + C if self.gpt2 else 0
        norms = 2 * (2 * C if self.gpt2 else C)
        return self.block_matmul_params() + biases + norms

    def root_params(self) -> int:
        """Everything outside the blocks: token (and position) embeddings, the final
        norm, and the head's matrix unless it is tied to the embedding."""
        C, V = self.d_model, self.vocab_size
        embeddings = V * C + (self.max_seq_len * C if self.gpt2 else 0)
        final_norm = 2 * C if self.gpt2 else C
        head = 0 if self.gpt2 else V * C  # GPT-2 ties the head to the token embedding
        return embeddings + final_norm + head

    def n_params(self) -> int:
        return self.n_layer * self.block_params() + self.root_params()

    def matmul_params(self) -> int:
        """Weights that multiply activations: every block's and the head's (tied
        or not)."""
        return (
            self.n_layer * self.block_matmul_params() + self.vocab_size * self.d_model
        )

    # --- end parameters ---

    def flops_per_token(self, seq_len: int) -> int:
        """The book's count (``distlab.flops``): 6 per matmul weight, plus 12*L*C*T for
        attention's two matmuls with the causal mask's skipped half counted, as MFU
        reports count it."""
        return training_flops_per_token(
            self.matmul_params(), self.n_layer, self.d_model, seq_len
        )

    # --- begin traffic ---
    def elementwise_values_per_token(self) -> dict[str, int]:
        """Values the memory-bound (non-matmul) ops of one block read and write per
        token, forward and backward, as eager PyTorch runs them: one kernel per op, each
        reading its inputs and writing its outputs in HBM. Forward: each norm reads C
        and writes C; each residual add reads 2C and writes C; GELU reads F, writes F;
        SwiGLU's SiLU reads F, writes F and its product reads 2F, writes F; rotary
        embedding reads and writes q and k. Backward: a norm reads its input and the
        gradient and writes one (3C); a residual add's gradient is summed where the two
        paths meet (3C); GELU reads its input and the gradient and writes one (3F);
        SwiGLU reads four tensors and writes two (6F); rotary reads and writes q and
        k's gradients."""
        C, kv, F = self.d_model, self.kv_dim, self.ffn_hidden
        rope = 0 if self.gpt2 else 2 * (C + kv)
        mlp_fwd, mlp_bwd = (2 * F, 3 * F) if self.gpt2 else (5 * F, 6 * F)
        forward = 2 * 2 * C + 2 * 3 * C + mlp_fwd + rope
        backward = 2 * 3 * C + 2 * 3 * C + mlp_bwd + rope
        return {"forward": forward, "backward": backward}

    def loss_bytes_per_token(self, value_bytes: int) -> int:
        """Bytes the loss moves per token, eager and unfused: the head writes the logits
        (V values), ``.float()`` reads them and writes fp32, log-softmax reads and
        writes fp32; backward writes the one-hot gradient, log-softmax's backward reads
        its output and that gradient and writes one, and the cast back reads fp32 and
        writes the compute dtype."""
        V, w = self.vocab_size, value_bytes
        forward = w * V + (w * V + 4 * V) + 2 * 4 * V
        backward = 4 * V + 3 * 4 * V + (4 * V + w * V)
        return forward + backward

    # --- end traffic ---


def from_gpt_config(name: str, label: str, cfg: GPTConfig, source: str) -> ModelShape:
    C = cfg.n_embd
    return ModelShape(
        name,
        label,
        cfg.n_layer,
        C,
        cfg.n_head,
        cfg.n_head,
        4 * C,
        cfg.vocab_size,
        cfg.block_size,
        "gpt2",
        source,
    )


GPT2_CONFIG = (
    "https://huggingface.co/openai-community/gpt2 (config.json: n_layer, n_embd, "
    "n_head, n_ctx 1024)"
)
LLAMA3_PARAMS = "Meta's Llama 3 params.json, as in the paper arXiv 2407.21783, Table 3"


def _gpt2(name: str, label: str, n_layer: int, n_embd: int, n_head: int) -> ModelShape:
    cfg = GPTConfig(
        vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )
    return from_gpt_config(name, label, cfg, GPT2_CONFIG)


def _llama3(
    name: str, label: str, n_layer: int, d: int, heads: int, ffn: int
) -> ModelShape:
    return ModelShape(
        name, label, n_layer, d, heads, 8, ffn, 128256, 8192, "llama", LLAMA3_PARAMS
    )


SHAPES: dict[str, ModelShape] = {
    "tiny": from_gpt_config(
        "tiny", "tiny (this book)", preset("tiny"), "distlab.model.PRESETS"
    ),
    "shakespeare": from_gpt_config(
        "shakespeare",
        "shakespeare (10.8M, this book)",
        preset("shakespeare"),
        "distlab.model.PRESETS",
    ),
    "gpt2-small": _gpt2("gpt2-small", "GPT-2 small (124M)", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", "GPT-2 medium (350M)", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", "GPT-2 large (774M)", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", "GPT-2 XL (1.5B)", 48, 1600, 25),
    "llama3-8b": _llama3("llama3-8b", "Llama 3 8B", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", "Llama 3 70B", 80, 8192, 64, 28672),
}


def shape(name: str) -> ModelShape:
    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]
