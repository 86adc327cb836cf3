"""What one policy's runs show: a summary per policy, with gaps paired per seed.

`summarize` turns run records into a `PolicySummary` (losses, the paired gap to
the baseline with its confidence interval, the baseline's seed spread and tail
improvement, memory, throughput, doctor findings); `mixprec.experiment.decision`
judges summaries against the contract's gates.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixprec.doctor.findings import UPDATE_PATH_RULES
from mixprec.experiment.records import RunRecord
from mixprec.experiment.stats import GapInterval, paired_interval

__all__ = [
    "TAIL_FRACTION",
    "PolicySummary",
    "Ratio",
    "format_interval",
    "summarize",
    "tail_start",
]


#: The runner evaluates every run after this share of a compared step, so the
#: training-length check can read the baseline's improvement over the last fifth.
TAIL_FRACTION = 0.2


def tail_start(step: int) -> int:
    """The step that opens the last fifth of a run compared at `step`."""
    return step - math.ceil(step * TAIL_FRACTION)


@dataclass(frozen=True, kw_only=True)
class Ratio:
    """A cost relative to the baseline, paired per seed: the candidate's figure over the
    baseline's on the same seed (runs of one seed run back to back, so the pairing
    also keeps the machine's state alike).

    Attributes:
        values: the per-seed ratios, in seed order (empty: nothing to pair).
    """

    values: tuple[float, ...] = ()

    @property
    def mean(self) -> float:
        """The mean ratio (NaN without values, or with a non-finite one)."""
        if not self.values or not all(math.isfinite(v) for v in self.values):
            return math.nan
        return statistics.fmean(self.values)

    @property
    def low(self) -> float:
        """The smallest per-seed ratio (NaN as `mean`)."""
        return min(self.values) if math.isfinite(self.mean) else math.nan

    @property
    def high(self) -> float:
        """The largest per-seed ratio (NaN as `mean`)."""
        return max(self.values) if math.isfinite(self.mean) else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the mean, its range over seeds and the per-seed values."""
        return {"mean": self.mean, "low": self.low, "high": self.high, "values": list(self.values)}


@dataclass(frozen=True, kw_only=True)
class PolicySummary:
    """One policy over its seeds.

    Attributes:
        policy: the policy name.
        seeds: the seeds that ran.
        steps: steps trained (a capped run is compared with the baseline at this step).
        heldout_loss: mean held-out loss over seeds.
        heldout_losses: held-out loss per seed, in seed order.
        metric: mean held-out metric.
        gap: the paired relative gaps ``(loss - baseline loss) / baseline loss``
            for each seed both ran, and their t-interval (empty for the baseline).
        baseline_spread: the baseline's own seed noise at `steps`: the relative
            standard deviation of its held-out loss across seeds (reported, not
            gated on: seeds move baseline and candidate together).
        tail_improvement: the baseline's relative held-out improvement over the
            last fifth of `steps` (mean over seeds; NaN when not evaluated there).
        improvement: the baseline's relative held-out improvement from step 0 to
            `steps` (mean over seeds; NaN when not evaluated there).
        total_bytes: mean measured training memory (all components).
        max_bytes: the largest seed's measured training memory.
        steps_per_s: mean training throughput.
        memory_ratio: measured memory over the baseline's, per seed (the
            baseline: 1).
        time_ratio: step time over the baseline's (the baseline's steps/s over
            this policy's), per seed (the baseline: 1).
        skipped_fraction: the worst seed's fraction of skipped steps.
        nonfinite_steps: the worst seed's count of non-finite-loss steps.
        frozen_fraction: mean share of parameter elements never changed.
        doctor_rules: union of the doctor's rule ids over seeds.
        update_errors: ``rule: message`` of error findings of update-path rules.
        failed: error messages of runs that did not finish.
    """

    policy: str
    seeds: tuple[int, ...]
    steps: int
    heldout_loss: float
    heldout_losses: tuple[float, ...]
    metric: float
    gap: GapInterval
    baseline_spread: float
    tail_improvement: float
    improvement: float
    total_bytes: float
    steps_per_s: float
    skipped_fraction: float
    nonfinite_steps: int
    frozen_fraction: float
    doctor_rules: tuple[str, ...]
    update_errors: Mapping[str, str] = field(default_factory=dict)
    failed: tuple[str, ...] = ()
    max_bytes: float = math.nan
    memory_ratio: Ratio = field(default_factory=Ratio)
    time_ratio: Ratio = field(default_factory=Ratio)

    @property
    def rel_gap(self) -> float:
        """The mean paired gap (NaN without pairs)."""
        return self.gap.mean

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures of this summary. Speed is `time_ratio` alone (paired per
        seed); the unpaired mean `steps_per_s` is left out (each run's own throughput
        is in results.json's ``runs``)."""
        return {
            "seeds": list(self.seeds),
            "steps": self.steps,
            "heldout_loss": self.heldout_loss,
            "heldout_losses": list(self.heldout_losses),
            "metric": self.metric,
            "gaps": list(self.gap.gaps),
            "gap_mean": self.gap.mean,
            "gap_low": self.gap.low,
            "gap_high": self.gap.high,
            "gap_sd": self.gap.sd,
            "confidence": self.gap.confidence,
            "paired_seeds": self.gap.n,
            "baseline_spread": self.baseline_spread,
            "tail_improvement": self.tail_improvement,
            "improvement": self.improvement,
            "total_bytes": self.total_bytes,
            "max_bytes": self.max_bytes,
            "memory_ratio": self.memory_ratio.to_dict(),
            "time_ratio": self.time_ratio.to_dict(),
            "skipped_fraction": self.skipped_fraction,
            "nonfinite_steps": self.nonfinite_steps,
            "frozen_fraction": self.frozen_fraction,
            "doctor_rules": list(self.doctor_rules),
            "update_errors": dict(self.update_errors),
            "failed": list(self.failed),
        }


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _relative_sd(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return math.nan
    mean = statistics.fmean(finite)
    return statistics.stdev(finite) / abs(mean) if mean else math.nan


def _improvement(base: Sequence[RunRecord], start: int, step: int) -> float:
    """Mean relative improvement of `base`'s held-out loss from `start` to `step`."""
    values = []
    for r in base:
        before, after = r.heldout_at(start), r.heldout_at(step)
        if not (math.isfinite(before) and math.isfinite(after)) or after == 0:
            return math.nan
        values.append((before - after) / abs(after))
    return _mean(values)


def _bytes(r: RunRecord) -> float:
    return float(r.bytes.get("total", math.nan))


def _speed(r: RunRecord) -> float:
    return float(r.throughput.get("steps_per_s", math.nan))


def _ratio(num: float, den: float) -> float:
    return num / den if math.isfinite(num) and math.isfinite(den) and den > 0 else math.nan


def _self_ratio(ok: Sequence[RunRecord], figure: Callable[[RunRecord], float]) -> Ratio:
    """The baseline's ratio to itself: 1 where it measured the figure."""
    if not ok:
        return Ratio()
    return Ratio(values=(1.0 if all(math.isfinite(figure(r)) for r in ok) else math.nan,))


def _update_errors(records: Sequence[RunRecord]) -> dict[str, str]:
    errors: dict[str, str] = {}
    for r in records:
        for f in r.doctor:
            rule = str(f.get("rule", ""))
            if f.get("severity") == "error" and rule in UPDATE_PATH_RULES and rule not in errors:
                errors[rule] = str(f.get("message", "")).strip()
    return errors


def summarize(
    records: Sequence[RunRecord],
    policy: str,
    baseline: Sequence[RunRecord],
    *,
    confidence: float = 0.90,
) -> PolicySummary:
    """Summarize `policy`'s records, with gaps paired per seed against `baseline`'s."""
    mine = sorted((r for r in records if r.policy == policy), key=lambda r: r.seed)
    ok = [r for r in mine if r.ok]
    base_ok = sorted((r for r in baseline if r.ok), key=lambda r: r.seed)
    base_by_seed = {r.seed: r for r in base_ok}
    # A capped run is compared with the baseline evaluated after the same step.
    at = ok[0].steps if ok else (mine[0].steps if mine else 0)
    is_baseline = any(r.policy == policy for r in baseline)
    gaps = []
    memory_ratios, time_ratios = [], []
    if not is_baseline:
        for r in ok:
            base = base_by_seed.get(r.seed)
            if base is None:
                continue
            # Relative to the baseline's magnitude, so a negative loss keeps the sign of "worse".
            ref = base.heldout_at(r.steps)
            gaps.append((r.heldout_loss - ref) / abs(ref) if ref else math.nan)
            memory_ratios.append(_ratio(_bytes(r), _bytes(base)))
            time_ratios.append(_ratio(_speed(base), _speed(r)))
    losses = tuple(r.heldout_loss for r in ok)
    return PolicySummary(
        policy=policy,
        seeds=tuple(r.seed for r in mine),
        heldout_loss=_mean(losses),
        heldout_losses=losses,
        metric=_mean([r.metric for r in ok]),
        gap=paired_interval(gaps, confidence),
        steps=at,
        baseline_spread=_relative_sd([b.heldout_at(at) for b in base_ok]),
        tail_improvement=_improvement(base_ok, tail_start(at), at) if at >= 2 else math.nan,
        improvement=_improvement(base_ok, 0, at),
        total_bytes=_mean([_bytes(r) for r in ok]),
        max_bytes=max((_bytes(r) for r in ok), default=math.nan),
        steps_per_s=_mean([_speed(r) for r in ok]),
        memory_ratio=_self_ratio(ok, _bytes) if is_baseline else Ratio(values=tuple(memory_ratios)),
        time_ratio=_self_ratio(ok, _speed) if is_baseline else Ratio(values=tuple(time_ratios)),
        skipped_fraction=max((r.skipped_steps / r.steps for r in mine if r.steps), default=0.0),
        nonfinite_steps=max((r.nonfinite_steps for r in mine), default=0),
        frozen_fraction=_mean([float(r.frozen_fraction.get("all", math.nan)) for r in ok]),
        doctor_rules=tuple(dict.fromkeys(rule for r in mine for rule in r.doctor_rules)),
        update_errors=_update_errors(mine),
        failed=tuple(f"seed {r.seed}: {r.error}" for r in mine if not r.ok),
    )


def _pct(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    return f"{value:+.2%}"


def format_interval(gap: GapInterval) -> str:
    """``+0.12% [-0.05%, +0.29%]``, or the mean alone when no interval exists."""
    if gap.n == 0:
        return "-"
    if gap.n == 1:
        return f"{_pct(gap.mean)} (1 seed)"
    return f"{_pct(gap.mean)} [{_pct(gap.low)}, {_pct(gap.high)}]"
