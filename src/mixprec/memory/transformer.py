"""Transformer shapes: parameters and activations of a decoder-only transformer from its config.

`estimate` reads a `TransformerShape` when no model is at hand (``mixprec budget
--config``): parameters and saved activations then follow closed forms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TransformerShape"]


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A decoder-only transformer described by its config (GPT/LLaMA style).

    The defaults describe a GPT-2 block (biases everywhere, LayerNorm with a bias);
    `from_config` sets every field from a transformers or nanoGPT config.

    Attributes:
        n_layer: transformer blocks.
        hidden: model width.
        n_head: attention (query) heads.
        vocab: vocabulary size.
        seq_len: tokens per sequence.
        micro_batch: sequences per rank per step.
        intermediate: MLP width (default 4 x hidden).
        gated_mlp: SwiGLU-style MLP with three matrices (LLaMA) instead of two.
        tied_embeddings: the output head shares the token embedding.
        learned_positions: a learned position embedding (GPT-2).
        positions: rows of that embedding, the longest sequence the model takes
            (``n_positions``; default seq_len).
        n_kv_head: key/value heads (grouped-query attention; default n_head).
        head_dim: width of one head (default hidden / n_head).
        qkv_bias: the query, key and value projections have biases.
        out_bias: the attention output projection has a bias.
        mlp_bias: the MLP's projections have biases.
        norm_bias: the norms have a bias (LayerNorm) besides their weight (RMSNorm).
        qk_norm: each block normalizes queries and keys per head (Qwen3's q_norm and
            k_norm, a head_dim weight each).
    """

    n_layer: int
    hidden: int
    n_head: int
    vocab: int
    seq_len: int
    micro_batch: int = 1
    intermediate: int | None = None
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = False
    positions: int | None = None
    n_kv_head: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    norm_bias: bool = True
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for f in ("n_layer", "hidden", "n_head", "vocab", "seq_len", "micro_batch"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        for f in ("intermediate", "n_kv_head", "head_dim", "positions"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{f} must be a positive integer or None, got {v!r}")
        if self.head_dim is None and self.hidden % self.n_head:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by n_head={self.n_head}: give head_dim"
            )
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}"
            )

    @property
    def ffn(self) -> int:
        """The MLP width."""
        return self.intermediate if self.intermediate is not None else 4 * self.hidden

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_head`, or `n_head` without grouped-query attention."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention output): n_head x head_dim."""
        return self.n_head * (self.head_dim or self.hidden // self.n_head)

    @property
    def kv_width(self) -> int:
        """Width of the keys, and of the values: kv_heads x head_dim."""
        return self.kv_heads * (self.head_dim or self.hidden // self.n_head)

    def largest_matrix(self) -> int:
        """Elements of the largest single weight: the token embedding (tied or not, a
        vocab x hidden matrix), an MLP matrix, or the query projection."""
        return max(self.vocab * self.hidden, self.hidden * self.ffn, self.hidden * self.q_width)

    def param_counts(self) -> tuple[int, int]:
        """(parameters in 16-bit-eligible matrices, biases and embeddings, parameters in norms)."""
        h, f, q, kv = self.hidden, self.ffn, self.q_width, self.kv_width
        attn = 2 * h * q + 2 * h * kv
        attn += (q + 2 * kv if self.qkv_bias else 0) + (h if self.out_bias else 0)
        mlp = (3 if self.gated_mlp else 2) * h * f
        mlp += ((2 * f if self.gated_mlp else f) + h) if self.mlp_bias else 0
        rows = self.positions if self.positions is not None else self.seq_len
        emb = self.vocab * h + (rows * h if self.learned_positions else 0)
        head = 0 if self.tied_embeddings else self.vocab * h
        norm = 2 * h if self.norm_bias else h
        norms = (2 * self.n_layer + 1) * norm
        if self.qk_norm:
            norms += self.n_layer * 2 * (self.head_dim or self.hidden // self.n_head)
        return self.n_layer * (attn + mlp) + emb + head, norms

    def activation_values(self) -> tuple[int, int]:
        """(values saved in the compute dtype, values saved in fp32) for one micro-batch.

        Per block, with fused attention (no s x s score matrix) and no dropout: the
        inputs of the attention and MLP blocks (``2 b s h``), the queries, keys and
        values (``b s (q + 2 kv)``: grouped-query attention saves fewer keys and
        values), the attention output and the output projection's copy of it
        (``2 b s q``), and the MLP's hidden activations (``2 b s ffn``, ``3 b s ffn``
        gated): ``(7 + 2 * ffn / hidden) * b * s * h`` values with full heads (as in
        Korthikanti et al. 2022, without the dropout masks). The two norm inputs and
        their statistics are kept in fp32, and so are the logits by the loss.
        """
        b, s, h, f = self.micro_batch, self.seq_len, self.hidden, self.ffn
        q, kv = self.q_width, self.kv_width
        per_block = b * s * (2 * h + q + 2 * kv + 2 * q + (3 if self.gated_mlp else 2) * f)
        compute = self.n_layer * per_block + b * s * h  # + the head's input
        norm_inputs = (2 * self.n_layer + 1) * (b * s * h + 2 * b * s)
        logits = 2 * b * s * self.vocab  # fp32 logits and their log-softmax
        return compute, norm_inputs + logits

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | Any,
        *,
        seq_len: int | None = None,
        micro_batch: int | None = None,
    ) -> TransformerShape:
        """Read a transformers-style config (HF ``config.json`` keys or nanoGPT's).

        Accepted keys: ``num_hidden_layers``/``n_layer``, ``hidden_size``/``n_embd``,
        ``num_attention_heads``/``n_head``, ``vocab_size``,
        ``max_position_embeddings``/``block_size``/``seq_len``, ``intermediate_size``,
        ``micro_batch_size``, ``tie_word_embeddings``, ``hidden_act`` (``silu``
        means a gated MLP), ``model_type``, ``num_key_value_heads``/``n_kv_heads``
        and ``head_dim`` (grouped-query attention), ``attention_bias``, ``mlp_bias``
        and nanoGPT's ``bias``. A config object with ``to_dict()`` (a transformers
        ``PretrainedConfig``) is read through it. Nothing is imported. Without
        `seq_len`, activations are sized for the config's longest sequence.
        """
        if not isinstance(config, Mapping):
            to_dict = getattr(config, "to_dict", None)
            if not callable(to_dict):
                raise TypeError(
                    f"config must be a mapping of config keys or have to_dict() (a "
                    f"transformers config), got {type(config).__name__}"
                )
            config = to_dict()

        def count(key: str, value: Any) -> int:
            # Whole numbers only: a string, a bool, a fraction or a NaN is a broken config.
            ok = isinstance(value, int) and not isinstance(value, bool)
            if isinstance(value, float) and math.isfinite(value) and value.is_integer():
                ok, value = True, int(value)
            if not ok or not 1 <= value <= 10**12:
                raise ValueError(
                    f"config key {key!r} must be a whole number from 1 to 1e12, got "
                    f"{value!r} ({type(value).__name__})"
                )
            return int(value)

        def pick(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if k in config and config[k] is not None:
                    return count(k, config[k])
            if default is None:
                fix = "; give seq_len= (--seq-len)" if "seq_len" in keys else ""
                raise ValueError(
                    f"config has none of {list(keys)}{fix}; keys present: "
                    f"{sorted(map(str, config))}"
                )
            return default

        def optional(*keys: str) -> int | None:
            return next((count(k, config[k]) for k in keys if config.get(k) is not None), None)

        model_type = str(config.get("model_type", "")).lower()
        gated = str(config.get("hidden_act", "")).lower() in ("silu", "swiglu") or model_type in (
            "llama",
            "mistral",
            "qwen2",
            "gemma",
            "mixtral",
            "phi3",
            "qwen3",
        )
        # GPT-2 and nanoGPT: biases everywhere and LayerNorm (nanoGPT's ``bias`` turns
        # both off). LLaMA-style (gated) blocks: RMSNorm, and biases only where
        # ``attention_bias`` / ``mlp_bias`` say (Qwen2: on q, k and v, always).
        bias = bool(config.get("bias", True))
        attention_bias = config.get("attention_bias")
        if gated:
            qkv_bias = bool(attention_bias) if attention_bias is not None else model_type == "qwen2"
            out_bias = bool(attention_bias)
            mlp_bias = bool(config.get("mlp_bias", False))
        else:
            qkv_bias = out_bias = mlp_bias = bias
        return cls(
            n_layer=int(pick("num_hidden_layers", "n_layer", "num_layers")),
            hidden=int(pick("hidden_size", "n_embd", "d_model")),
            n_head=int(pick("num_attention_heads", "n_head")),
            vocab=int(pick("vocab_size")),
            seq_len=int(
                seq_len or pick("seq_len", "max_position_embeddings", "block_size", "n_positions")
            ),
            micro_batch=int(micro_batch or pick("micro_batch_size", default=1)),
            intermediate=optional("intermediate_size"),
            gated_mlp=gated,
            tied_embeddings=bool(config.get("tie_word_embeddings", model_type in ("gpt2", ""))),
            learned_positions=model_type in ("gpt2",)
            or "n_positions" in config
            or "block_size" in config,
            positions=optional("n_positions", "block_size", "max_position_embeddings"),
            n_kv_head=optional("num_key_value_heads", "n_kv_head", "n_kv_heads"),
            head_dim=optional("head_dim"),
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            mlp_bias=mlp_bias,
            norm_bias=bias and not gated,
            qk_norm=model_type == "qwen3",
        )
