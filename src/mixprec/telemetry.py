"""Step telemetry: what one step did (`StepReport`) and what a run did (`PrecisionStats`).

Plain data with validated round trips: a saved state that no run could have
written (negative counts, a NaN scale, contradictory totals) is refused on load,
as is a `torch.amp.GradScaler` state that torch would accept and fail on later.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["PrecisionStats", "StepReport", "check_scaler_state"]


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What happened in one optimizer step.

    Attributes:
        step: the index of this step (0-based, counting skipped steps).
        applied: whether the optimizer update was applied (False: skipped, params
            and optimizer state untouched).
        scale: the loss scale the gradients of this step carried (None without
            loss scaling).
        next_scale: the loss scale for the next step (None without loss scaling).
        grad_norm: the true (unscaled, pre-clip) total gradient norm; inf or NaN
            when gradients were non-finite.
        nonfinite_grads: how many gradient elements were inf or NaN, over every
            gradient of every optimizer of the step (whatever clipping saw).
        stepped: for each optimizer of the step, in the order given, whether it
            applied an update (False for all on a skipped step; False for one
            whose parameters had no gradient).
        nonfinite_weights: after an applied update, how many elements of the
            parameters stored in fp16 that it wrote are inf or NaN: finite
            gradients whose update left fp16's range (max 65504). The update is
            not undone. 0 on a skipped step and when no parameter is stored in
            fp16 (bf16 and fp32 storage share fp32's range and are not checked).
        loss_finite: on a skipped step, whether every loss given to
            ``prec.backward`` this step was finite (on this rank): True means the
            gradients overflowed in backward, False that the forward pass or the
            loss did. None on an applied step, or when no loss went through
            ``prec.backward``.
        released_params: under gradient release (`Policy.release_gradients`), how many
            parameters were stepped during this step's backward; 0 otherwise.
        withheld_params: under gradient release, how many parameters were not
            stepped because their gradient, or one completed before it in that
            backward, was non-finite (or the loss was). A step with withheld
            parameters is not ``applied``, but the ``released_params`` stepped before
            the first non-finite gradient keep their (finite) update.
    """

    step: int
    applied: bool
    scale: float | None
    next_scale: float | None
    grad_norm: float
    nonfinite_grads: int
    stepped: tuple[bool, ...] = ()
    nonfinite_weights: int = 0
    loss_finite: bool | None = None
    released_params: int = 0
    withheld_params: int = 0

    @property
    def skipped(self) -> bool:
        """The update was not applied."""
        return not self.applied


@dataclass(kw_only=True)
class PrecisionStats:
    """Telemetry accumulated by a `Precision` over its steps.

    Attributes:
        steps: optimizer steps attempted.
        applied_steps: steps whose update was applied.
        skipped_steps: steps skipped because gradients were non-finite.
        consecutive_skips: skipped steps since the last applied one.
        last_nonfinite_step: index of the last step with non-finite gradients, or None.
        loss_scale: the current loss scale (None without loss scaling).
        scale_history: ``(step, scale)`` pairs, one per change of the loss scale
            (the most recent `history_size` of them), starting with the initial scale.
    """

    steps: int = 0
    applied_steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    last_nonfinite_step: int | None = None
    loss_scale: float | None = None
    history_size: int = 1000
    scale_history: deque[tuple[int, float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.scale_history = deque(self.scale_history, maxlen=self.history_size)

    def record_scale(self, step: int, scale: float) -> None:
        """Note the loss scale in force from `step` on, if it changed."""
        if not self.scale_history or self.scale_history[-1][1] != scale:
            self.scale_history.append((step, scale))
        self.loss_scale = scale

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["scale_history"] = [list(item) for item in self.scale_history]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrecisionStats:
        """Inverse of `to_dict`, validated.

        Raises:
            ValueError: a missing key, a wrong type, or counts that contradict each other.
        """
        if not isinstance(data, dict):
            raise ValueError(f"telemetry must be a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(data))
        unknown = sorted(map(str, set(data) - names))
        if missing or unknown:
            raise ValueError(f"telemetry keys: missing {missing}, unknown {unknown}")

        def count(key: str) -> int:
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"telemetry {key!r} must be an int >= 0, got {v!r}")
            return v

        values = {k: count(k) for k in ("steps", "applied_steps", "skipped_steps")}
        values["consecutive_skips"] = count("consecutive_skips")
        values["history_size"] = count("history_size")
        if values["applied_steps"] + values["skipped_steps"] != values["steps"]:
            raise ValueError("telemetry: applied_steps + skipped_steps must equal steps")
        if values["consecutive_skips"] > values["skipped_steps"] or values["history_size"] < 1:
            raise ValueError("telemetry: consecutive_skips exceeds skipped_steps or no history")
        last = data["last_nonfinite_step"]
        if last is not None and (
            isinstance(last, bool) or not isinstance(last, int) or not 0 <= last < values["steps"]
        ):
            raise ValueError(f"telemetry 'last_nonfinite_step' is out of range: {last!r}")
        scale = data["loss_scale"]
        if scale is not None and not _positive_finite(scale):
            raise ValueError(f"telemetry 'loss_scale' must be finite and > 0, got {scale!r}")
        raw = data["scale_history"]
        if not isinstance(raw, list | tuple):
            raise ValueError(f"telemetry 'scale_history' must be a list, got {raw!r}")
        history = []
        for item in raw:
            ok = isinstance(item, list | tuple) and len(item) == 2
            if not ok or isinstance(item[0], bool) or not isinstance(item[0], int):
                raise ValueError(f"telemetry scale_history entry must be [step, scale]: {item!r}")
            if item[0] < 0 or not _positive_finite(item[1]):
                raise ValueError(f"telemetry scale_history entry out of range: {item!r}")
            history.append((int(item[0]), float(item[1])))
        return cls(
            **values,
            last_nonfinite_step=last,
            loss_scale=None if scale is None else float(scale),
            scale_history=deque(history),
        )


def _positive_finite(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= torch.finfo(torch.float32).max
    )


def check_scaler_state(state: dict[str, Any]) -> None:
    """Refuse a GradScaler state that torch would take and fail on later."""
    expected = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    missing = [k for k in expected if k not in state]
    if missing:
        raise ValueError(f"saved scaler state is missing {missing}")
    scale = state["scale"]
    if not _positive_finite(scale) or (isinstance(scale, int) and scale > 2**53):
        raise ValueError(
            f"saved loss scale must be finite, > 0 and within fp32, got {state['scale']!r}"
        )
    growth, backoff = state["growth_factor"], state["backoff_factor"]
    if not (_positive_finite(growth) and growth > 1):
        raise ValueError(f"saved growth_factor must be a finite number > 1, got {growth!r}")
    if not (_positive_finite(backoff) and backoff < 1):
        raise ValueError(f"saved backoff_factor must be in (0, 1), got {backoff!r}")
    for key, least in (("growth_interval", 1), ("_growth_tracker", 0)):
        v = state[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"saved {key} must be an int >= {least}, got {v!r}")
