"""The `Workload` shape: what a training runner needs to train and judge one task.

A workload is plain data plus four callables, so a user can build one without
subclassing anything:

* `make_model(seed)` returns a fresh fp32 model on the CPU; the same seed gives
  bitwise identical initial weights, and the caller's global RNG is untouched.
* `train_batch(step=, seed=, batch_size=, device=)` returns `(inputs, targets)`
  for one optimizer step. It depends only on its arguments, so every precision
  policy sees the same data in the same order.
* `loss(output, target)` returns a scalar fp32 loss (logits are upcast first).
* `evaluate(model, autocast=)` returns an `EvalResult` on the held-out split,
  without gradients, with the model in eval mode and its modes restored after.

Its training settings (`Workload.defaults`) are a `TrainSettings`
(`mixprec.workloads.settings`), which an experiment contract may override.

The helpers here (`seeded_init`, `batch_generator`, `evaluation_mode`,
`model_device`) are what the built-in workloads use to keep those promises;
user workloads can use them too. `apply_overrides` and `config_record` serve
the built-in configs.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from mixprec.workloads.settings import TrainSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "AutocastFactory",
    "BatchFn",
    "EvalResult",
    "EvaluateFn",
    "LossFn",
    "ModelFn",
    "Workload",
    "apply_overrides",
    "batch_generator",
    "config_record",
    "evaluation_mode",
    "model_device",
    "seeded_init",
    "stream_seed",
]

#: A zero-argument callable returning a context manager, e.g. `Precision.autocast`,
#: `lambda: torch.autocast("cpu", dtype=torch.bfloat16)` or `contextlib.nullcontext`.
AutocastFactory = Callable[[], AbstractContextManager[object]]

#: `make_model(seed)`: a fresh fp32 model on the CPU, bitwise determined by `seed`.
ModelFn = Callable[[int], nn.Module]

#: `loss(output, target)`: a scalar fp32 loss.
LossFn = Callable[[Tensor, Tensor], Tensor]


class BatchFn(Protocol):
    """`train_batch`: the `(inputs, targets)` of one optimizer step.

    Keyword-only, because `step` and `seed` are both ints and easy to swap.
    """

    def __call__(
        self, *, step: int, seed: int, batch_size: int, device: torch.device | str
    ) -> tuple[Tensor, Tensor]: ...


class EvaluateFn(Protocol):
    """`evaluate`: held-out loss and metric of a model (device taken from the model)."""

    def __call__(self, model: nn.Module, *, autocast: AutocastFactory) -> EvalResult: ...


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """Held-out evaluation of one model."""

    loss: float
    """Mean held-out loss (cross-entropy in nats per target)."""
    metric: float
    """The workload's metric (see `Workload.metric_name`)."""
    metric_name: str
    """Name of `metric`, e.g. `"bits_per_char"` or `"macro_f1"`."""
    num_targets: int
    """Number of targets the loss is averaged over (characters, examples)."""
    extras: dict[str, float] = field(default_factory=dict, hash=False)
    """Further held-out numbers (e.g. accuracy); a private copy, treat as read-only."""

    def __post_init__(self) -> None:
        # A plain dict (not a read-only proxy) so results pickle, deepcopy and
        # go through dataclasses.asdict; copied so the caller's dict stays theirs.
        object.__setattr__(self, "extras", dict(self.extras))

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict of all fields."""
        return {
            "loss": self.loss,
            "metric": self.metric,
            "metric_name": self.metric_name,
            "num_targets": self.num_targets,
            "extras": dict(self.extras),
        }


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training task: model factory, deterministic data, held-out split, metric.

    Build one directly (no subclassing) from four callables; see the module
    docstring for what each must promise. `config` records the knobs the
    workload was built with, for run records.
    """

    name: str
    """Short identifier, e.g. `"shakespeare"`."""
    description: str
    """One line saying what is trained on what."""
    metric_name: str
    """Name of the held-out metric, e.g. `"bits_per_char"`."""
    higher_is_better: bool
    """Whether a larger metric is better (macro-F1) or worse (bits per char)."""
    defaults: TrainSettings
    """Training settings a runner uses unless told otherwise (a contract overrides them)."""
    make_model: ModelFn
    """`make_model(seed)`: fresh fp32 CPU model, bitwise determined by `seed`."""
    train_batch: BatchFn
    """`train_batch(step=, seed=, batch_size=, device=)`: one step's `(inputs, targets)`."""
    loss: LossFn
    """`loss(output, target)`: scalar fp32 training loss."""
    evaluate: EvaluateFn
    """`evaluate(model, autocast=)`: held-out `EvalResult`."""
    config: dict[str, object] = field(default_factory=dict, hash=False)
    """The knobs the workload was built with, for run records (a copy; treat as read-only)."""

    def __post_init__(self) -> None:
        for name in ("name", "description", "metric_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Workload.{name} must be a non-empty str, got {value!r}")
        for name in ("make_model", "train_batch", "loss", "evaluate"):
            if not callable(getattr(self, name)):
                raise TypeError(
                    f"Workload.{name} must be callable, got {type(getattr(self, name)).__name__}"
                )
        if not isinstance(self.defaults, TrainSettings):
            raise TypeError(
                f"Workload.defaults must be a TrainSettings, got {type(self.defaults).__name__}"
            )
        object.__setattr__(self, "config", dict(self.config))


def seeded_init(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a model with the global CPU RNG seeded to `seed`, then restore that RNG.

    Same seed gives bitwise identical initial weights; the caller's RNG stream
    is left exactly where it was, so model creation never shifts anything else.
    """
    _check_nonnegative_int("seed", seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def stream_seed(seed: int, step: int, *, stream: str) -> int:
    """A 63-bit seed determined by `(seed, step, stream)` alone.

    The three are hashed together by numpy's `SeedSequence` (so nearby seeds
    and steps give unrelated streams); `stream` keeps different uses apart.
    """
    _check_nonnegative_int("seed", seed)
    _check_nonnegative_int("step", step)
    words = np.random.SeedSequence([seed, step, zlib.crc32(stream.encode())]).generate_state(
        2, dtype=np.uint32
    )
    return (int(words[0]) << 31) ^ int(words[1])


def batch_generator(seed: int, step: int, *, stream: str) -> torch.Generator:
    """A CPU generator seeded by `stream_seed(seed, step, stream=stream)`."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(stream_seed(seed, step, stream=stream))
    return generator


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Put `model` in eval mode under `torch.no_grad()`; restore every submodule's mode after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU if it has neither."""
    for param in model.parameters():
        return param.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


_C = TypeVar("_C", bound="DataclassInstance")


def apply_overrides(base: _C, overrides: Mapping[str, object], *, what: str) -> _C:
    """Return the dataclass `base` with `overrides` applied, rejecting unknown names.

    A config that composes its training settings as a `train: TrainSettings`
    field also takes their fields by name: `steps=100` replaces `train.steps`.

    Args:
        base: A dataclass instance (a workload config preset).
        overrides: Field names to new values; validated by the dataclass itself.
        what: Name used in the error message, e.g. `"shakespeare"`.

    Raises:
        ValueError: An override names no field of `base` (nor of its `train`).
    """
    own = {f.name for f in fields(base)}
    train = getattr(base, "train", None)
    nested = {f.name for f in fields(TrainSettings)} if isinstance(train, TrainSettings) else set()
    valid = sorted(own | nested)
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown {what} option(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}"
        )
    changes = {name: value for name, value in overrides.items() if name in own}
    train_changes: dict[str, Any] = {k: v for k, v in overrides.items() if k not in own}
    if train_changes:
        current = changes.get("train", train)
        if not isinstance(current, TrainSettings):
            raise TypeError(f"{what} option train must be a TrainSettings, got {current!r}")
        changes["train"] = replace(current, **train_changes)
    return replace(base, **changes)


def config_record(config: DataclassInstance) -> dict[str, object]:
    """A workload config as the flat dict `Workload.config` records.

    The fields of its `train` settings sit beside its own knobs, one level deep
    (`record["lr"]`, not `record["train"]["lr"]`).
    """
    record = asdict(config)
    train = record.pop("train", None)
    if isinstance(train, dict):
        record.update(train)
    return record


def _check_nonnegative_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
