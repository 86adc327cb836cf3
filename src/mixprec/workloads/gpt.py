"""A small GPT (decoder-only transformer) for the character-level workload.

The shape follows nanoGPT's `model.py`: token and position embeddings,
pre-LayerNorm blocks of causal self-attention and a GELU MLP, a final
LayerNorm and a language-model head (tied to the token embedding by default).
Attention goes through `F.scaled_dot_product_attention`, so each backend picks
its best kernel. The model returns logits; the loss is the workload's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a `GPT`."""

    vocab_size: int
    """Number of token ids (characters plus UNK for the Shakespeare workload)."""
    block_size: int = 64
    """Longest sequence (context length) the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide `n_embd`."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual branches (0 for exact parity runs)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""
    tie_weights: bool = True
    """Share the LM head weight with the token embedding."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                f"valid n_head: {[h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        out: Tensor = self.resid_dropout(self.c_proj(y))
        return out


class MLP(nn.Module):
    """The 4x-wide GELU feed-forward branch."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.c_proj(self.gelu(self.c_fc(x))))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """Decoder-only transformer returning next-token logits of shape (B, T, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init as in nanoGPT: N(0, 0.02) everywhere, residual output
        # projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        """Logits for token ids `idx` of shape (B, T) with T <= block_size."""
        seq_len = idx.shape[1]
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence length {seq_len} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.lm_head(self.ln_f(x))
        return logits
