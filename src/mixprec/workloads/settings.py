"""`TrainSettings`: the one schema of how a run trains, and its learning-rate schedule.

Every training setting is named, documented and checked here once:

* a workload carries its defaults as a `TrainSettings` (`Workload.defaults`; the
  built-in size presets compose one beside their model and data knobs);
* an experiment contract overrides some fields by name, and
  `TrainSettings.with_overrides` resolves them against the workload's defaults;
* the runner trains with the result, and `lr_at` reads the schedule from it.

It lives in `mixprec.workloads` because workloads carry it and the experiment is
built on workloads; a workload never imports the experiment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["TrainDefaults", "TrainSettings", "lr_at"]


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """How a run trains: its length and batch, AdamW's settings, the learning-rate schedule.

    The schedule is nanoGPT's (`lr_at`): linear warmup to `lr` over
    `warmup_steps`, then cosine decay to `min_lr` at `steps`. Float fields are
    stored as floats (an int `lr=1` becomes 1.0).

    Raises:
        ValueError: A field out of range, naming the value and what would be valid.
    """

    steps: int
    """Optimizer steps of a full run (the schedule ends here)."""
    batch_size: int
    """Examples (sequences for language models) per step."""
    lr: float
    """Peak learning rate, reached at the end of the warmup."""
    min_lr: float
    """Learning rate at the end of the cosine decay; at most `lr`."""
    warmup_steps: int
    """Steps of linear warmup to `lr`; at most `steps` (0: none)."""
    weight_decay: float
    """Decoupled (AdamW) weight decay."""
    grad_clip_norm: float | None
    """Global gradient-norm clip, or None for none (inf: the norm is measured, nothing clipped)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's running-average coefficients `(beta1, beta2)`."""

    def __post_init__(self) -> None:
        for name in _NAMES:
            object.__setattr__(self, name, _check(name, getattr(self, name)))
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"warmup_steps must be an int in [0, steps={self.steps}], got "
                f"{self.warmup_steps!r}: warm up for at most the whole run"
            )
        if self.min_lr > self.lr:
            raise ValueError(_min_lr_above_lr(self.min_lr, self.lr))

    @classmethod
    def check_overrides(cls, overrides: Mapping[str, object]) -> dict[str, Any]:
        """Some fields by name, each checked on its own (a contract's overrides).

        A None value is dropped: it means "not overridden" (the JSON form of a
        contract writes the fields it leaves alone as null). `min_lr` is checked
        against `lr` when both are given; `warmup_steps` against `steps` only
        when resolved (`with_overrides`).

        Returns:
            The given fields with valid, normalized values (floats as floats,
            `betas` as a tuple).

        Raises:
            ValueError: A name that is no field (listing the valid ones) or a bad value.
        """
        if not isinstance(overrides, Mapping):
            raise ValueError(
                f"training overrides must be a mapping of {', '.join(_NAMES)}, got {overrides!r}"
            )
        unknown = sorted(str(k) for k in overrides if k not in _NAMES)
        if unknown:
            raise ValueError(
                f"unknown training setting(s) {', '.join(map(repr, unknown))}; "
                f"valid: {', '.join(_NAMES)}"
            )
        checked = {
            str(name): _check(str(name), value)
            for name, value in overrides.items()
            if value is not None
        }
        if "lr" in checked and "min_lr" in checked and checked["min_lr"] > checked["lr"]:
            raise ValueError(_min_lr_above_lr(checked["min_lr"], checked["lr"]))
        return checked

    def with_overrides(self, overrides: Mapping[str, object]) -> TrainSettings:
        """These settings with some fields replaced: how a contract overrides a workload.

        Fields left out (or None) keep their value here. `warmup_steps` is then
        clamped to `steps`, so that a shortened run keeps a warmup no longer
        than itself.

        Raises:
            ValueError: An unknown name or a bad value; or `min_lr` above `lr`
                where only one of them was overridden (override both).
        """
        changes = self.check_overrides(overrides)
        lr = changes.get("lr", self.lr)
        min_lr = changes.get("min_lr", self.min_lr)
        if min_lr > lr:
            kept = "min_lr" if "lr" in changes else "lr"
            raise ValueError(
                f"min_lr {min_lr:g} exceeds lr {lr:g} (overriding one, {kept} kept its default "
                f"{getattr(self, kept):g}): the schedule would rise; override both"
            )
        steps = changes.get("steps", self.steps)
        changes["warmup_steps"] = min(changes.get("warmup_steps", self.warmup_steps), steps)
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready data (`betas` as a list)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _NAMES}
        out["betas"] = list(self.betas)
        return out


#: The former name of `TrainSettings` (a workload's defaults), kept for user workloads.
TrainDefaults = TrainSettings

#: Field names of `TrainSettings`, in declaration order.
_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TrainSettings))


def lr_at(step: int, settings: TrainSettings) -> float:
    """The learning rate of optimizer step `step` (0-based) under `settings` (nanoGPT's).

    Linear warmup: step `k < warmup_steps` gets `lr * (k + 1) / warmup_steps`;
    then cosine decay from `lr` to `min_lr` at `steps`, flat at `min_lr` after.
    """
    s = settings
    if s.warmup_steps and step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    span = max(s.steps - s.warmup_steps, 1)
    progress = min(max((step - s.warmup_steps) / span, 0.0), 1.0)
    return s.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (s.lr - s.min_lr)


def _min_lr_above_lr(min_lr: float, lr: float) -> str:
    return (
        f"min_lr ({min_lr:g}) must not exceed lr ({lr:g}): the cosine decay would rise; "
        "lower min_lr or raise lr"
    )


def _as_float(value: object) -> float | None:
    """`value` as a float when it is an int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _positive_int(name: str, value: object, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int ({meaning}), got {value!r}")
    return value


def _number(name: str, value: object, *, low: float, strict: bool, hint: str) -> float:
    """`value` as a finite float above `low` (or at least `low` unless `strict`)."""
    out = _as_float(value)
    if out is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(out) or out < low or (strict and out == low):
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {op} {low:g} ({hint}), got {value!r}")
    return out


def _check(name: str, value: object) -> Any:
    """One field's value, checked and normalized."""
    if name == "steps":
        return _positive_int(name, value, "optimizer steps of a full run")
    if name == "batch_size":
        return _positive_int(name, value, "examples per step")
    if name == "warmup_steps":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"warmup_steps must be an int >= 0 (0: no warmup), got {value!r}")
        return value
    if name == "lr":
        return _number(name, value, low=0.0, strict=True, hint="the peak learning rate, e.g. 3e-4")
    if name == "min_lr":
        return _number(name, value, low=0.0, strict=False, hint="where the cosine decay ends")
    if name == "weight_decay":
        return _number(name, value, low=0.0, strict=False, hint="e.g. 0.01; 0: no decay")
    if name == "grad_clip_norm":
        clip = _as_float(value)
        if value is None:
            return None
        if clip is None or not clip > 0:  # NaN fails too
            raise ValueError(
                f"grad_clip_norm must be a number > 0 (e.g. 1.0; inf measures without "
                f"clipping) or None (no clipping), got {value!r}"
            )
        return clip
    if name == "betas":
        pair = [_as_float(b) for b in value] if isinstance(value, tuple | list) else []
        beta1, beta2 = pair if len(pair) == 2 else (None, None)
        if beta1 is None or beta2 is None or not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(
                f"betas must be two numbers in [0, 1) (AdamW's beta1, beta2, e.g. "
                f"(0.9, 0.99)), got {value!r}"
            )
        return (beta1, beta2)
    raise AssertionError(f"no check for TrainSettings.{name}")  # pragma: no cover
