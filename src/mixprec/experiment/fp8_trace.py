"""The FP8 trace of a run: what the fp8 casts did to each layer's tensors over training.

The doctor's probe samples every fp8 layer's weight, input and output gradient
on its sampled steps (`mixprec.doctor.ProbeSample.fp8`). A run record keeps a
compact trace of those samples (`Fp8Trace`, the record's ``fp8_trace``): per
tensor, for each sampled step, its amax, the scale its cast used, the share of
its elements clipped at the format's max (saturated), the share of its non-zero
elements flushed to zero (underflow), and the share Transformer Engine's delayed
scaling would have clipped (the probe's what-if).

The trace is bounded, whatever the model's size and the run's length:

* the `MAX_TRACE_TENSORS` worst tensors are kept in full, worst first: by the
  larger of their peak saturated and peak underflow fractions, then by the
  what-if's peak saturation, then by peak amax (the order of the layers breaks a
  tie);
* the other tensors are aggregated, one row per role (``layer`` says how many
  layers, `Fp8TensorTrace.tensors` counts them): per step the largest amax and
  fractions and the smallest scale among them (a role with one tensor left
  keeps it as it is);
* a tensor sampled on more than `MAX_TRACE_POINTS` steps keeps that many points:
  consecutive samples are merged into buckets (the bucket's last step, largest
  amax and fractions, smallest scale), so a peak is never dropped.

The trace is plain data: `Fp8Trace.to_dict` and `Fp8Trace.from_dict` (validated,
naming the bad field) round-trip through a record's JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mixprec.floats import FP8_NAMES

if TYPE_CHECKING:
    from mixprec.doctor.runtime.fp8_measure import Fp8TensorSample

__all__ = [
    "MAX_TRACE_POINTS",
    "MAX_TRACE_TENSORS",
    "TRACE_ROLES",
    "Fp8TensorTrace",
    "Fp8Trace",
    "build_fp8_trace",
]

#: Tensors (layer and role) kept in full in a record, worst first.
MAX_TRACE_TENSORS = 8

#: Most sampled steps kept per tensor (more are merged into buckets).
MAX_TRACE_POINTS = 200

#: The tensor roles of an fp8 linear, in the order the trace lists aggregates.
TRACE_ROLES = ("weight", "input", "grad_output")

_SERIES = ("amax", "scale", "saturated", "underflow", "delayed_saturated")


def _nanmax(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def _nanmin(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else math.nan


#: How each series merges several values (samples of a bucket, tensors of an aggregate).
_MERGE: Mapping[str, Callable[[Sequence[float]], float]] = {
    "amax": _nanmax,
    "scale": _nanmin,
    "saturated": _nanmax,
    "underflow": _nanmax,
    "delayed_saturated": _nanmax,
}


@dataclass(frozen=True, kw_only=True)
class Fp8TensorTrace:
    """One fp8 tensor over the sampled steps, or several of one role aggregated.

    Attributes:
        layer: the layer's qualified name (an aggregate: ``"N other layers"``).
        role: ``weight``, ``input`` or ``grad_output``.
        format: the fp8 format it is cast to (``fp8_e4m3``; ``mixed`` for an
            aggregate over several).
        tensors: how many tensors this row stands for (1, or more for an aggregate).
        steps: the sampled steps (a bucket's last step).
        amax: the tensor's largest magnitude at each step.
        scale: the smallest scale its casts used (the only one for a tensorwise
            cast; a rowwise cast's row with the largest amax).
        saturated: share of its elements clipped at the format's max (measured,
            the worst of its casts).
        underflow: share of its non-zero elements flushed to zero (measured, the
            worst of its casts).
        delayed_saturated: share the delayed-scaling what-if would clip (NaN on a
            tensor's first sample: no amax history yet).
    """

    layer: str
    role: str
    format: str
    tensors: int = 1
    steps: tuple[int, ...]
    amax: tuple[float, ...]
    scale: tuple[float, ...]
    saturated: tuple[float, ...]
    underflow: tuple[float, ...]
    delayed_saturated: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.steps)
        for name in _SERIES:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"fp8 trace of {self.layer} ({self.role}): {name} has "
                    f"{len(getattr(self, name))} values for {n} steps"
                )
        if self.tensors < 1:
            raise ValueError(f"fp8 trace of {self.layer}: tensors={self.tensors} must be >= 1")
        what = f"fp8 trace of {self.layer} ({self.role})"
        if self.role not in TRACE_ROLES:
            raise ValueError(f"{what}: role must be one of {', '.join(TRACE_ROLES)}")
        if self.format != "mixed" and self.format not in FP8_NAMES:
            raise ValueError(
                f"{what}: format {self.format!r} is not an fp8 format "
                f"({', '.join(sorted(FP8_NAMES))}, or mixed)"
            )
        for name in ("saturated", "underflow", "delayed_saturated"):
            bad = [v for v in getattr(self, name) if not (0.0 <= v <= 1.0 or math.isnan(v))]
            if bad:
                raise ValueError(f"{what}: {name} holds {bad[0]!r}, not a fraction in [0, 1]")
        for name in ("amax", "scale"):
            bad = [v for v in getattr(self, name) if not (v >= 0.0 or math.isnan(v))]
            if bad:
                raise ValueError(f"{what}: {name} holds {bad[0]!r}, not >= 0")

    @property
    def aggregated(self) -> bool:
        """This row stands for several tensors (the ones not kept in full)."""
        return self.tensors > 1

    @property
    def label(self) -> str:
        """``layer (role)``, as the doctor's findings name a tensor."""
        return f"{self.layer} ({self.role})"

    @property
    def peak_saturated(self) -> float:
        """The largest saturated fraction over the steps (0.0 without steps)."""
        return max(self.saturated, default=0.0)

    @property
    def peak_underflow(self) -> float:
        """The largest underflow fraction over the steps (0.0 without steps)."""
        return max(self.underflow, default=0.0)

    @property
    def peak_delayed_saturated(self) -> float:
        """The largest what-if saturated fraction (NaN when never computed)."""
        return _nanmax(self.delayed_saturated)

    @property
    def mean_underflow(self) -> float:
        """The mean underflow fraction over the steps (NaN without steps)."""
        return sum(self.underflow) / len(self.underflow) if self.underflow else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a NaN stays a float; records are written as strict JSON)."""
        out: dict[str, Any] = {
            "layer": self.layer,
            "role": self.role,
            "format": self.format,
            "tensors": self.tensors,
            "steps": list(self.steps),
        }
        for name in _SERIES:
            out[name] = list(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "fp8_trace.tensors[]") -> Fp8TensorTrace:
        """Inverse of `to_dict`, validated (``null`` reads back as NaN).

        Raises:
            ValueError: a missing or mistyped field, naming it.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"field {where!r} must be an object, got {data!r}")
        for key in ("layer", "role", "format"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"field '{where}.{key}' must be a string, got {data.get(key)!r}")
        tensors = data.get("tensors", 1)
        if isinstance(tensors, bool) or not isinstance(tensors, int) or tensors < 1:
            raise ValueError(f"field '{where}.tensors' must be an int >= 1, got {tensors!r}")
        steps = data.get("steps")
        if not isinstance(steps, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps
        ):
            raise ValueError(f"field '{where}.steps' must be a list of steps (ints >= 0)")
        series = {name: _floats(f"{where}.{name}", data.get(name)) for name in _SERIES}
        try:
            return _trace_of(
                data["layer"], data["role"], data["format"], tensors, tuple(steps), series
            )
        except ValueError as exc:
            raise ValueError(f"field {where!r}: {exc}") from None


def _floats(key: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise ValueError(f"field {key!r} must be a list of numbers, got {value!r}")
    out = []
    for v in value:
        if v is None:
            out.append(math.nan)
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"field {key!r} must hold numbers or null, got {v!r}")
        else:
            out.append(float(v))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Fp8Trace:
    """A run's fp8 trace: its worst tensors in full, the rest aggregated by role.

    Attributes:
        layers: fp8 layers the probe measured.
        samples: sampled steps (before any bucketing).
        tensors: the worst tensors, worst first, then one aggregate per role.
    """

    layers: int
    samples: int
    tensors: tuple[Fp8TensorTrace, ...]

    @property
    def worst(self) -> tuple[Fp8TensorTrace, ...]:
        """The tensors kept in full, worst first (no aggregates)."""
        return tuple(t for t in self.tensors if not t.aggregated)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "layers": self.layers,
            "samples": self.samples,
            "tensors": [t.to_dict() for t in self.tensors],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Fp8Trace:
        """Inverse of `to_dict`, validated.

        Raises:
            ValueError: a missing or mistyped field, naming it.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"field 'fp8_trace' must be an object or null, got {data!r}")
        for key in ("layers", "samples"):
            v = data.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"field 'fp8_trace.{key}' must be an int >= 0, got {v!r}")
        tensors = data.get("tensors")
        if not isinstance(tensors, list):
            raise ValueError(f"field 'fp8_trace.tensors' must be a list, got {tensors!r}")
        most = MAX_TRACE_TENSORS + len(TRACE_ROLES)  # the worst in full, one aggregate a role
        if len(tensors) > most:
            raise ValueError(
                f"field 'fp8_trace.tensors' holds {len(tensors)} tensors, more than a trace "
                f"keeps ({most})"
            )
        return cls(
            layers=data["layers"],
            samples=data["samples"],
            tensors=tuple(
                Fp8TensorTrace.from_dict(t, f"fp8_trace.tensors[{i}]")
                for i, t in enumerate(tensors)
            ),
        )


def _merge_steps(
    steps: Sequence[int], series: Mapping[str, Sequence[float]], limit: int
) -> tuple[tuple[int, ...], dict[str, tuple[float, ...]]]:
    """At most `limit` points: consecutive samples merged into equal buckets (`_MERGE`)."""
    n = len(steps)
    if n <= limit:
        return tuple(steps), {k: tuple(v) for k, v in series.items()}
    bounds = [round(i * n / limit) for i in range(limit + 1)]
    merged_steps = tuple(steps[bounds[i + 1] - 1] for i in range(limit))
    merged = {
        k: tuple(_MERGE[k](v[bounds[i] : bounds[i + 1]]) for i in range(limit))
        for k, v in series.items()
    }
    return merged_steps, merged


def _severity(t: Fp8TensorTrace) -> tuple[float, float, float]:
    delayed = t.peak_delayed_saturated
    return (
        max(t.peak_saturated, t.peak_underflow),
        0.0 if math.isnan(delayed) else delayed,
        _nanmax(t.amax) if t.amax else 0.0,
    )


def _aggregate(role: str, rest: Sequence[Fp8TensorTrace], limit: int) -> Fp8TensorTrace:
    steps = sorted({s for t in rest for s in t.steps})
    at = [{s: i for i, s in enumerate(t.steps)} for t in rest]
    series = {
        name: [
            _MERGE[name](
                [getattr(t, name)[idx[s]] for t, idx in zip(rest, at, strict=True) if s in idx]
            )
            for s in steps
        ]
        for name in _SERIES
    }
    merged_steps, merged = _merge_steps(steps, series, limit)
    formats = {t.format for t in rest}
    return _trace_of(
        f"{len({t.layer for t in rest})} other layers",
        role,
        formats.pop() if len(formats) == 1 else "mixed",
        len(rest),
        merged_steps,
        merged,
    )


def _trace_of(
    layer: str,
    role: str,
    fmt: str,
    tensors: int,
    steps: tuple[int, ...],
    series: Mapping[str, tuple[float, ...]],
) -> Fp8TensorTrace:
    return Fp8TensorTrace(
        layer=layer,
        role=role,
        format=fmt,
        tensors=tensors,
        steps=steps,
        amax=series["amax"],
        scale=series["scale"],
        saturated=series["saturated"],
        underflow=series["underflow"],
        delayed_saturated=series["delayed_saturated"],
    )


def build_fp8_trace(
    samples: Sequence[Fp8TensorSample],
    *,
    max_tensors: int = MAX_TRACE_TENSORS,
    max_points: int = MAX_TRACE_POINTS,
) -> Fp8Trace | None:
    """The bounded trace of the probe's fp8 samples (None without any).

    Args:
        samples: every sampled fp8 tensor of a run (`ProbeSample.fp8` of each sampled
            step, in step order).
        max_tensors: tensors kept in full, worst first (the others are aggregated
            per role).
        max_points: most points per tensor (more sampled steps are bucketed).

    Raises:
        ValueError: `max_tensors` < 0 or `max_points` < 1.
    """
    if max_tensors < 0:
        raise ValueError(f"max_tensors={max_tensors} must be >= 0")
    if max_points < 1:
        raise ValueError(f"max_points={max_points} must be >= 1")
    if not samples:
        return None
    by_tensor: dict[tuple[str, str], list[Fp8TensorSample]] = {}
    for s in samples:
        by_tensor.setdefault((s.layer, s.role), []).append(s)
    full: list[Fp8TensorTrace] = []
    for (layer, role), items in by_tensor.items():
        items = sorted(items, key=lambda s: s.step)
        series = {
            "amax": [s.amax for s in items],
            "scale": [min((c.stats.scale_min for c in s.casts), default=math.nan) for s in items],
            "saturated": [s.saturated_fraction for s in items],
            "underflow": [s.underflow_fraction for s in items],
            "delayed_saturated": [
                math.nan if s.delayed is None else s.delayed_saturated_fraction for s in items
            ],
        }
        steps, merged = _merge_steps([s.step for s in items], series, max_points)
        full.append(_trace_of(layer, role, items[0].format, 1, steps, merged))
    # Stable: equally bad tensors stay in the order the layers were sampled.
    ranked = sorted(full, key=_severity, reverse=True)
    kept, rest = ranked[:max_tensors], ranked[max_tensors:]
    aggregates = []
    for role in dict.fromkeys([*TRACE_ROLES, *(t.role for t in rest)]):
        left = [t for t in rest if t.role == role]
        if len(left) == 1:
            aggregates.append(left[0])  # one tensor: itself, in full
        elif left:
            aggregates.append(_aggregate(role, left, max_points))
    return Fp8Trace(
        layers=len({s.layer for s in samples}),
        samples=len({s.step for s in samples}),
        tensors=(*kept, *aggregates),
    )
