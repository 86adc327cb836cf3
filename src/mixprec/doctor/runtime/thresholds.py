"""Every threshold of the runtime probes, in one frozen record.

Each diagnosis reads its own fields; `Probe` builds the record from its keyword
arguments, so the defaults below are the probe's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["AMAX_ALGOS", "ProbeThresholds", "check_count"]

#: Transformer Engine's ``amax_compute_algo`` choices (``DelayedScaling``).
AMAX_ALGOS: tuple[str, ...] = ("max", "most_recent")


def check_count(name: str, value: object, least: int) -> None:
    """Raise ValueError unless `value` is an int (not a bool) of at least `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ProbeThresholds:
    """When each runtime diagnosis reports (validated on construction).

    Attributes:
        underflow_threshold: ``gradient-underflow`` in runs that do not compute in
            fp16: the share of gradient elements below fp16's smallest subnormal
            that is reported (in (0, 1]).
        zero_threshold: ``gradient-underflow`` in fp16-compute runs: the share of
            gradient elements exactly zero that is reported (in (0, 1]).
        vanishing_threshold: ``vanishing-updates``: the share of intended non-zero
            updates that left a 16-bit parameter unchanged that is reported (in (0, 1]).
        window: ``loss-scale-collapse``: steps looked at for the scale trend.
        collapse_octaves: ``loss-scale-collapse``: a scale this many binary orders
            below its initial value, with `min_skips` skips, has collapsed.
        falling_run: ``loss-scale-collapse``: so many scale decreases in a row, with
            most recent steps skipped, is a collapse too.
        min_skips: ``loss-scale-collapse``: skipped steps in the window needed for
            the `collapse_octaves` criterion.
        hunt_steps: ``nonfinite-source``: how many steps a hunt keeps its forward
            hooks after a step with non-finite gradients.
        max_hunts: ``nonfinite-source``: at most this many hunts per run (bounds
            the cost when overflow is routine, as under dynamic loss scaling).
        fp8_saturation_threshold: ``fp8-saturation``: the share of a cast's elements
            clipped at the fp8 format's max that is reported (in (0, 1]); measured
            under the layer's own scaling, and as a what-if under delayed scaling.
        fp8_underflow_threshold: ``fp8-underflow``: the share of a cast's non-zero
            elements flushed to zero that is reported (in (0, 1]).
        fp8_amax_history_len: the amax history the probe keeps per fp8 tensor, in
            samples (TE's ``amax_history_len`` counts steps; see docs/doctor.md).
        fp8_margin: the delayed-scaling what-if's ``margin`` (scale divided by
            ``2**margin``, as Transformer Engine's ``DelayedScaling``).
        fp8_amax_compute_algo: the what-if's ``amax_compute_algo``: ``"max"`` (the
            history's largest amax, TE's default) or ``"most_recent"``.
    """

    underflow_threshold: float = 0.01
    zero_threshold: float = 0.05
    vanishing_threshold: float = 0.05
    window: int = 50
    collapse_octaves: int = 12
    falling_run: int = 8
    min_skips: int = 3
    hunt_steps: int = 3
    max_hunts: int = 3
    fp8_saturation_threshold: float = 0.001
    fp8_underflow_threshold: float = 0.01
    fp8_amax_history_len: int = 16
    fp8_margin: int = 0
    fp8_amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "fp8_amax_compute_algo":
                if value not in AMAX_ALGOS:
                    raise ValueError(
                        f"fp8_amax_compute_algo must be one of {', '.join(AMAX_ALGOS)}, "
                        f"got {value!r}"
                    )
                continue
            if f.name.endswith("_threshold"):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise TypeError(f"{f.name} must be a number in (0, 1], got {value!r}")
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"{f.name} must be in (0, 1], got {value!r}")
            else:
                least = 0 if f.name in ("min_skips", "max_hunts", "fp8_margin") else 1
                check_count(f.name, value, least)
