"""The `digits` workload: an MLP classifying scikit-learn's bundled 8x8 digit images.

Data: `sklearn.datasets.load_digits` (1797 images, 10 classes; shipped inside
scikit-learn, so nothing is downloaded), its file read without importing
scikit-learn. A stratified split with a fixed seed
holds out `held_out_fraction` of each class. Inputs are standardized with the
mean and standard deviation of the training split only.

Batches walk through a fresh permutation of the training set each epoch; the
permutation of epoch `e` is drawn from a generator seeded from `(seed, e)`, so
batch `step` depends only on `(seed, step, batch_size)`.

Metric: macro-F1 on the held-out split (higher is better); extras: accuracy.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np
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
from mixprec.workloads.metrics import accuracy, macro_f1
from mixprec.workloads.settings import TrainSettings

__all__ = [
    "DIGITS_SIZES",
    "DigitsConfig",
    "DigitsData",
    "class_loss",
    "digits_workload",
    "load_digits_split",
    "stratified_split",
]

NUM_CLASSES = 10
NUM_FEATURES = 64


#: Training settings of the `default` size (AdamW, warmup then cosine decay).
_DEFAULT_TRAIN = TrainSettings(
    steps=300,
    batch_size=64,
    lr=3e-3,
    min_lr=3e-4,
    warmup_steps=20,
    weight_decay=0.01,
    grad_clip_norm=1.0,
)


@dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """Every knob of the `digits` workload: model shape, data split, and training settings."""

    hidden_sizes: tuple[int, ...] = (128, 128)
    """Widths of the hidden layers (GELU after each)."""
    held_out_fraction: float = 0.2
    """Fraction of each class held out."""
    split_seed: int = 0
    """Seed of the stratified split (fixed, independent of the training seed)."""
    train: TrainSettings = _DEFAULT_TRAIN
    """Default training settings (`Workload.defaults`; a contract may override them)."""

    def __post_init__(self) -> None:
        if isinstance(self.hidden_sizes, int) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in self.hidden_sizes
        ):
            raise ValueError(
                f"hidden_sizes must be a sequence of positive ints, got {self.hidden_sizes!r}"
            )
        object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction!r}")
        if isinstance(self.split_seed, bool) or not isinstance(self.split_seed, int):
            raise ValueError(f"split_seed must be an int, got {self.split_seed!r}")
        if not isinstance(self.train, TrainSettings):
            raise TypeError(f"train must be a TrainSettings, got {type(self.train).__name__}")


#: Size presets. `default` is about 26k parameters; `tiny` is for tests.
DIGITS_SIZES: Mapping[str, DigitsConfig] = MappingProxyType(
    {
        "tiny": DigitsConfig(
            hidden_sizes=(32,),
            train=replace(
                _DEFAULT_TRAIN, steps=50, batch_size=32, lr=1e-2, min_lr=1e-3, warmup_steps=5
            ),
        ),
        "default": DigitsConfig(),
    }
)


@dataclass(frozen=True, kw_only=True, eq=False)
class DigitsData:
    """The standardized split. Shared through a cache: treat the tensors as read-only."""

    train_x: Tensor
    """Training inputs, float32 of shape (n_train, 64), standardized."""
    train_y: Tensor
    """Training labels, int64 of shape (n_train,)."""
    held_out_x: Tensor
    """Held-out inputs, standardized with the training statistics."""
    held_out_y: Tensor
    """Held-out labels."""
    train_index: Tensor
    """Row indices into `load_digits()` of the training examples."""
    held_out_index: Tensor
    """Row indices into `load_digits()` of the held-out examples."""


def stratified_split(
    labels: np.ndarray, *, held_out_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices so each class keeps (about) `held_out_fraction` held out.

    Per class, `round(n_class * held_out_fraction)` rows (at least one, at most
    `n_class - 1`) are drawn without replacement by `numpy.random.default_rng(seed)`.

    Returns:
        `(train_index, held_out_index)`, each sorted.
    """
    rng = np.random.default_rng(seed)
    held: list[np.ndarray] = []
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        if rows.size < 2:
            raise ValueError(f"class {label!r} has {rows.size} example(s); a split needs 2")
        n_held = min(max(round(rows.size * held_out_fraction), 1), rows.size - 1)
        held.append(rng.choice(rows, size=n_held, replace=False))
    held_index = np.sort(np.concatenate(held))
    train_index = np.setdiff1d(np.arange(labels.size), held_index)
    return train_index, held_index


#: The digits data inside the scikit-learn package (what `load_digits` reads).
_DIGITS_FILE = ("datasets", "data", "digits.csv.gz")


def load_digits_split(*, held_out_fraction: float = 0.2, split_seed: int = 0) -> DigitsData:
    """Load, split and standardize the digits data (cached per split)."""
    return _load_digits_split(held_out_fraction, split_seed)


@functools.lru_cache(maxsize=4)
def _load_digits_split(held_out_fraction: float, split_seed: int) -> DigitsData:
    features, labels = _load_digits_arrays()
    train_index, held_index = stratified_split(
        labels, held_out_fraction=held_out_fraction, seed=split_seed
    )
    train = features[train_index]
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    # Some border pixels are always 0 in training: leave them at 0, not 0/0.
    std[std == 0] = 1.0

    def standardize(x: np.ndarray) -> Tensor:
        return torch.from_numpy(((x - mean) / std).astype(np.float32))

    return DigitsData(
        train_x=standardize(train),
        train_y=torch.from_numpy(labels[train_index]).long(),
        held_out_x=standardize(features[held_index]),
        held_out_y=torch.from_numpy(labels[held_index]).long(),
        train_index=torch.from_numpy(train_index).long(),
        held_out_index=torch.from_numpy(held_index).long(),
    )


@functools.lru_cache(maxsize=1)
def _load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    # scikit-learn's own file, read as `load_digits` reads it (np.loadtxt of the gzipped
    # CSV; the label last) without importing scikit-learn: its import (scipy.stats
    # among it) cost each new process running digits as much as importing torch.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the digits workload reads scikit-learn's bundled digits data; install it with: "
            "pip install 'mixprec[data]' (or pip install scikit-learn)"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *_DIGITS_FILE)
    if path.is_file():
        with gzip.open(path, mode="rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")
        return data[:, :-1].astype(np.float64), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # a scikit-learn that keeps it elsewhere

    bunch = load_digits()
    return np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def digits_workload(*, size: str = "default", **overrides: object) -> Workload:
    """The `digits` workload at a size preset, with any knob overridden.

    Args:
        size: A key of `DIGITS_SIZES`: `"tiny"` or `"default"`.
        **overrides: Fields of `DigitsConfig`, e.g. `hidden_sizes=(64,)`, or of its
            `TrainSettings`, e.g. `steps=100`.

    Raises:
        ValueError: Unknown size or option, or an invalid value.
        ImportError: scikit-learn is missing.
    """
    if size not in DIGITS_SIZES:
        raise ValueError(f"unknown digits size {size!r}; valid: {', '.join(DIGITS_SIZES)}")
    config = apply_overrides(DIGITS_SIZES[size], overrides, what="digits")
    return _build(config, size=size)


def _make_mlp(hidden_sizes: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = NUM_FEATURES
    for hidden in hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.GELU()]
        width = hidden
    layers.append(nn.Linear(width, NUM_CLASSES))
    return nn.Sequential(*layers)


def _build(config: DigitsConfig, *, size: str) -> Workload:
    data = load_digits_split(
        held_out_fraction=config.held_out_fraction, split_seed=config.split_seed
    )
    n_train = data.train_y.numel()

    def make_model(seed: int) -> nn.Module:
        return seeded_init(seed, lambda: _make_mlp(config.hidden_sizes))

    def train_batch(
        *, step: int, seed: int, batch_size: int, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        # Example positions step*B .. step*B+B-1 in the endless sequence of epochs.
        positions = torch.arange(step * batch_size, (step + 1) * batch_size)
        epochs = positions // n_train
        rows = torch.empty_like(positions)
        for epoch in range(int(epochs[0]), int(epochs[-1]) + 1):
            order = torch.randperm(
                n_train, generator=batch_generator(seed, epoch, stream="digits/epoch")
            )
            mask = epochs == epoch
            rows[mask] = order[positions[mask] % n_train]
        return data.train_x[rows].to(device), data.train_y[rows].to(device)

    def evaluate(model: nn.Module, *, autocast: AutocastFactory) -> EvalResult:
        device = model_device(model)
        targets = data.held_out_y
        with evaluation_mode(model):
            with autocast():
                logits = model(data.held_out_x.to(device))
            loss = float(class_loss(logits, targets.to(device)))
        pred = logits.argmax(dim=-1).cpu()
        f1 = macro_f1(pred, targets, num_classes=NUM_CLASSES)
        return EvalResult(
            loss=loss,
            metric=f1,
            metric_name="macro_f1",
            num_targets=targets.numel(),
            extras={"accuracy": accuracy(pred, targets)},
        )

    with torch.device("meta"):  # shapes only: no memory, no RNG draws
        num_params = sum(p.numel() for p in _make_mlp(config.hidden_sizes).parameters())
    record: dict[str, object] = {
        "size": size,
        **config_record(config),
        "num_params": num_params,
        "train_examples": n_train,
        "held_out_examples": data.held_out_y.numel(),
    }
    return Workload(
        name="digits",
        description=(
            f"MLP {NUM_FEATURES}-{'-'.join(map(str, config.hidden_sizes))}-{NUM_CLASSES} "
            f"({num_params:,} params) on scikit-learn 8x8 digits; "
            f"{data.held_out_y.numel()} of {n_train + data.held_out_y.numel()} images held out"
        ),
        metric_name="macro_f1",
        higher_is_better=True,
        defaults=config.train,
        make_model=make_model,
        train_batch=train_batch,
        loss=class_loss,
        evaluate=evaluate,
        config=record,
    )


def class_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy in nats, computed on fp32 logits."""
    return F.cross_entropy(output.float(), target)
