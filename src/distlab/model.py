"""A small GPT (nanoGPT-style) for character-level Tiny Shakespeare.

This file knows nothing about parallelism, on purpose: DDP, FSDP2 and activation
checkpointing are applied to the model from outside (``distlab.parallel`` in later
chapters), so this file stays byte-identical from lab 1 to lab 6.

Architecture: token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks
(causal self-attention through ``scaled_dot_product_attention``, then a GELU MLP), a
final LayerNorm and a language-model head tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65  # distinct characters in Tiny Shakespeare
    block_size: int = 256  # longest context the model sees (T)
    n_layer: int = 6  # transformer blocks
    n_head: int = 6  # attention heads; n_embd must divide evenly among them
    n_embd: int = 384  # width of the residual stream (C)
    # 0 keeps runs deterministic, so distributed runs can match exactly
    dropout: float = 0.0


PRESETS: dict[str, GPTConfig] = {
    # seconds per run on 2 CPU cores: for tests and the notebooks
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64),
    # the classic shakespeare-char model (nanoGPT's config, with biases):
    # 10.77M parameters
    "shakespeare": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    # GPT-2 small's shape, for GPU benchmarks (2x the depth and width, 4x the context of
    # shakespeare's): 85.89M parameters with the 65-character vocabulary (124.44M, GPT-2
    # small's count, with its 50,257 tokens)
    "gpt2": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The named preset, with fields such as ``vocab_size`` overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # q, k, v for all heads at once
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # token embedding
        # learned position embedding
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        # a ModuleList of blocks is the unit that FSDP2 shards and checkpointing wraps
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # weight tying (GPT-2): one matrix, two uses
        self.lm_head.weight = self.wte.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation, drawn on the CPU from a private generator.

        Drawing on the CPU gives the same numbers whatever device the parameters live
        on, and a private generator makes the weights depend on ``seed`` alone, not on
        what else drew from the global RNG before.
        """
        gen = torch.Generator().manual_seed(seed)

        def normal_(p: torch.Tensor, std: float) -> None:
            p.copy_(torch.randn(p.shape, generator=gen) * std)

        # residual projections are scaled down so the residual stream's variance does
        # not grow with depth (GPT-2 paper, section 2.3)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head:
                    continue  # tied to wte, initialised below
                normal_(module.weight, resid_std if name.endswith(".proj") else 0.02)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                normal_(module.weight, 0.02)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab) and the
        mean loss."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt ``idx`` (B, T)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            probs = F.softmax(logits[:, -1, :].float() / temperature, dim=-1)
            idx = torch.cat(
                [idx, torch.multinomial(probs, 1, generator=generator)], dim=1
            )
        return idx


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters: a tied matrix counts once (``parameters()``
    deduplicates)."""
    return sum(p.numel() for p in model.parameters())


def parameter_formula(
    cfg: GPTConfig, bias: bool = True, include_wpe: bool = True
) -> int:
    """The parameter count of ``GPT(cfg)`` worked out by hand, layer by layer.

    ``bias=False`` drops every Linear and LayerNorm bias and ``include_wpe=False``
    leaves out the position embedding, which is how other code reports this
    model's size.
    """
    C, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    b = 1 if bias else 0
    attn = C * 3 * C + b * 3 * C + C * C + b * C  # qkv and output projection
    mlp = C * 4 * C + b * 4 * C + 4 * C * C + b * C  # fc and projection
    layer_norms = 2 * (C + b * C)  # two LayerNorms per block (weight, bias)
    per_block = attn + mlp + layer_norms
    embeddings = V * C + (T * C if include_wpe else 0)  # lm_head shares wte's matrix
    return L * per_block + embeddings + (C + b * C)  # + final LayerNorm
