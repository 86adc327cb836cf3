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

    Attributes:
        n_layer: transformer blocks.
        hidden: model width.
        n_head: attention heads.
        vocab: vocabulary size.
        seq_len: tokens per sequence.
        micro_batch: sequences per rank per step.
        intermediate: MLP width (default 4 x hidden).
        gated_mlp: SwiGLU-style MLP with three matrices (LLaMA) instead of two.
        tied_embeddings: the output head shares the token embedding.
        learned_positions: a learned position embedding (GPT-2) of seq_len rows.
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

    def __post_init__(self) -> None:
        for f in ("n_layer", "hidden", "n_head", "vocab", "seq_len", "micro_batch"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if self.hidden % self.n_head:
            raise ValueError(f"hidden={self.hidden} is not divisible by n_head={self.n_head}")

    @property
    def ffn(self) -> int:
        """The MLP width."""
        return self.intermediate if self.intermediate is not None else 4 * self.hidden

    def param_counts(self) -> tuple[int, int]:
        """(parameters in 16-bit-eligible matrices and embeddings, parameters in norms)."""
        h, f = self.hidden, self.ffn
        attn = 4 * h * h + 4 * h
        mlp = (3 * h * f) if self.gated_mlp else (2 * h * f + f + h)
        emb = self.vocab * h + (self.seq_len * h if self.learned_positions else 0)
        head = 0 if self.tied_embeddings else self.vocab * h
        norms = self.n_layer * 4 * h + 2 * h
        return self.n_layer * (attn + mlp) + emb + head, norms

    def activation_values(self) -> tuple[int, int]:
        """(values saved in the compute dtype, values saved in fp32) for one micro-batch.

        Per block, with fused attention (no s x s score matrix) and no dropout:
        inputs of the four linear layers and the MLP activation, q/k/v and the
        attention output: ``(10 + 2 * ffn / hidden) * b * s * h`` values (34 b s h
        bytes in 16 bits for ffn = 4h, as in Korthikanti et al. 2022 without the
        dropout masks); the two norm inputs and their statistics in fp32; and the
        logits kept in fp32 by the loss.
        """
        b, s, h, f = self.micro_batch, self.seq_len, self.hidden, self.ffn
        bsh = b * s * h
        per_block = (
            3 * bsh + bsh + bsh + 2 * bsh + (2 if self.gated_mlp else 1) * b * s * f + b * s * f
        )
        compute = self.n_layer * per_block + bsh  # + the head's input
        norm_inputs = (2 * self.n_layer + 1) * (bsh + 2 * b * s)
        logits = 2 * b * s * self.vocab  # fp32 logits and their log-softmax
        return compute, norm_inputs + logits

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        seq_len: int | None = None,
        micro_batch: int | None = None,
    ) -> TransformerShape:
        """Read a transformers-style config (HF ``config.json`` keys or nanoGPT's).

        Accepted keys: ``num_hidden_layers``/``n_layer``, ``hidden_size``/``n_embd``,
        ``num_attention_heads``/``n_head``, ``vocab_size``,
        ``max_position_embeddings``/``block_size``/``seq_len``, ``intermediate_size``,
        ``micro_batch_size``, ``tie_word_embeddings``, ``hidden_act`` (``silu``
        means a gated MLP) and ``model_type``. Nothing is imported.
        """

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
                raise ValueError(
                    f"config has none of {list(keys)}; keys present: {sorted(map(str, config))}"
                )
            return default

        model_type = str(config.get("model_type", "")).lower()
        gated = str(config.get("hidden_act", "")).lower() in ("silu", "swiglu") or model_type in (
            "llama",
            "mistral",
            "qwen2",
            "gemma",
            "mixtral",
        )
        return cls(
            n_layer=int(pick("num_hidden_layers", "n_layer", "num_layers")),
            hidden=int(pick("hidden_size", "n_embd", "d_model")),
            n_head=int(pick("num_attention_heads", "n_head")),
            vocab=int(pick("vocab_size")),
            seq_len=int(
                seq_len or pick("seq_len", "max_position_embeddings", "block_size", "n_positions")
            ),
            micro_batch=int(micro_batch or pick("micro_batch_size", default=1)),
            intermediate=count("intermediate_size", config["intermediate_size"])
            if config.get("intermediate_size")
            else None,
            gated_mlp=gated,
            tied_embeddings=bool(config.get("tie_word_embeddings", model_type in ("gpt2", ""))),
            learned_positions=model_type in ("gpt2",)
            or "n_positions" in config
            or "block_size" in config,
        )
