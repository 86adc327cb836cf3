"""The decision: which candidates pass the gates, and which one to recommend.

Pure functions over run records and the contract, so a decision can be tested
on constructed records and re-judged from stored ones.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixprec.experiment.contract import Contract, Gates
from mixprec.experiment.records import RunRecord

__all__ = ["Decision", "PolicySummary", "decide", "summarize"]


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
        rel_gap: mean over seeds of ``(loss - baseline loss) / baseline loss`` for the
            same seed (0 for the baseline).
        noise: the seed noise the gap is judged against (relative half-range of
            held-out loss between seeds, the larger of baseline's and this policy's).
        total_bytes: mean measured training memory (all components).
        steps_per_s: mean training throughput.
        skipped_fraction: the worst seed's fraction of skipped steps.
        nonfinite_steps: the worst seed's count of non-finite-loss steps.
        frozen_fraction: mean share of parameter elements never changed.
        doctor_rules: union of the doctor's rule ids over seeds.
        failed: error messages of runs that did not finish.
    """

    policy: str
    seeds: tuple[int, ...]
    steps: int
    heldout_loss: float
    heldout_losses: tuple[float, ...]
    metric: float
    rel_gap: float
    noise: float
    total_bytes: float
    steps_per_s: float
    skipped_fraction: float
    nonfinite_steps: int
    frozen_fraction: float
    doctor_rules: tuple[str, ...]
    failed: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The verdict of an experiment.

    Attributes:
        baseline: the baseline policy.
        baseline_ok: the baseline passed its own gates (if not, nothing can be judged).
        baseline_reason: why the baseline failed, or empty.
        eligible: candidates that passed every gate, in contract order.
        rejected: candidate -> the gate that rejected it (first failing gate).
        notes: candidate -> remarks that did not reject it (e.g. a gap within noise).
        recommended: the cheapest eligible candidate by measured memory, then speed;
            None when none is eligible.
        summaries: per-policy summaries, baseline first.
    """

    baseline: str
    baseline_ok: bool
    baseline_reason: str
    eligible: tuple[str, ...]
    rejected: Mapping[str, str]
    notes: Mapping[str, str]
    recommended: str | None
    summaries: tuple[PolicySummary, ...] = field(default=())

    @property
    def success(self) -> bool:
        """The baseline passed and at least one candidate is eligible."""
        return self.baseline_ok and self.recommended is not None

    def to_dict(self) -> dict[str, Any]:
        """The ``decision`` object of results.json."""
        return {
            "baseline": self.baseline,
            "baseline_ok": self.baseline_ok,
            "baseline_reason": self.baseline_reason,
            "eligible": list(self.eligible),
            "rejected": dict(self.rejected),
            "notes": dict(self.notes),
            "recommended": self.recommended,
        }


def _half_range(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return 0.0
    mean = statistics.fmean(finite)
    return (max(finite) - min(finite)) / 2 / abs(mean) if mean else 0.0


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def summarize(
    records: Sequence[RunRecord], policy: str, baseline: Sequence[RunRecord]
) -> PolicySummary:
    """Summarize `policy`'s records, with gaps taken per seed against `baseline`'s."""
    mine = sorted((r for r in records if r.policy == policy), key=lambda r: r.seed)
    ok = [r for r in mine if r.ok]
    base_by_seed = {r.seed: r for r in baseline if r.ok}
    # A capped run is compared with the baseline evaluated after the same step.
    at = ok[0].steps if ok else 0
    gaps = []
    for r in ok:
        base = base_by_seed.get(r.seed)
        ref = base.heldout_at(r.steps) if base is not None else math.nan
        gaps.append((r.heldout_loss - ref) / ref if ref else math.nan)
    base_noise = _half_range([b.heldout_at(at) for b in base_by_seed.values()])
    losses = tuple(r.heldout_loss for r in ok)
    return PolicySummary(
        policy=policy,
        seeds=tuple(r.seed for r in mine),
        heldout_loss=_mean(losses),
        heldout_losses=losses,
        metric=_mean([r.metric for r in ok]),
        rel_gap=_mean(gaps) if gaps else math.nan,
        steps=at,
        noise=max(base_noise, _half_range(losses)),
        total_bytes=_mean([float(r.bytes.get("total", math.nan)) for r in ok]),
        steps_per_s=_mean([float(r.throughput.get("steps_per_s", math.nan)) for r in ok]),
        skipped_fraction=max((r.skipped_steps / r.steps for r in mine if r.steps), default=0.0),
        nonfinite_steps=max((r.nonfinite_steps for r in mine), default=0),
        frozen_fraction=_mean([float(r.frozen_fraction.get("all", math.nan)) for r in ok]),
        doctor_rules=tuple(dict.fromkeys(rule for r in mine for rule in r.doctor_rules)),
        failed=tuple(f"seed {r.seed}: {r.error}" for r in mine if not r.ok),
    )


def _gate_failure(
    s: PolicySummary, gates: Gates, higher_is_better: bool, records: Sequence[RunRecord]
) -> str:
    """The first gate `s` fails, as a sentence, or empty."""
    if s.failed:
        return f"run failed ({s.failed[0]})"
    if not s.seeds:
        return "no runs"
    if s.nonfinite_steps > gates.max_nonfinite_steps:
        return (
            f"{s.nonfinite_steps} non-finite-loss steps > "
            f"max_nonfinite_steps={gates.max_nonfinite_steps}"
        )
    if s.skipped_fraction > gates.max_skipped_fraction:
        return (
            f"{s.skipped_fraction:.1%} of steps skipped > max_skipped_fraction="
            f"{gates.max_skipped_fraction:.1%}"
        )
    if gates.metric_threshold is not None:
        for r in records:
            if r.policy != s.policy:
                continue
            bad = (
                r.metric < gates.metric_threshold
                if higher_is_better
                else r.metric > gates.metric_threshold
            )
            if bad or not math.isfinite(r.metric):
                op = ">=" if higher_is_better else "<="
                return (
                    f"{r.metric_name} {r.metric:.4g} (seed {r.seed}) misses "
                    f"{op} {gates.metric_threshold:g}"
                )
    return ""


def decide(records: Sequence[RunRecord], contract: Contract, *, higher_is_better: bool) -> Decision:
    """Judge every candidate against the baseline under the contract's gates.

    A candidate is rejected by the first gate it fails: a failed run, non-finite
    losses, too many skipped steps, the metric threshold, or a held-out loss gap
    larger than both ``max_rel_loss_gap`` and ``noise_multiplier`` x seed noise.
    A gap above ``max_rel_loss_gap`` but within noise is eligible with a note.
    The recommendation is the eligible candidate with the least measured memory;
    candidates within 2% of that memory are ordered by throughput.
    """
    gates = contract.gates
    base_records = [r for r in records if r.policy == contract.baseline]
    base = summarize(records, contract.baseline, base_records)
    base_reason = _gate_failure(base, gates, higher_is_better, records)
    summaries = [base]
    eligible: list[str] = []
    rejected: dict[str, str] = {}
    notes: dict[str, str] = {}
    for name in contract.candidates:
        s = summarize(records, name, base_records)
        summaries.append(s)
        if base_reason:
            rejected[name] = "not judged: the baseline failed its gates"
            continue
        reason = _gate_failure(s, gates, higher_is_better, records)
        if not reason and math.isfinite(s.rel_gap) and s.rel_gap > gates.max_rel_loss_gap:
            threshold = gates.noise_multiplier * s.noise
            if s.rel_gap > threshold:
                reason = (
                    f"held-out loss {s.rel_gap:+.2%} vs {contract.baseline} > max gap "
                    f"{gates.max_rel_loss_gap:.2%} and > {gates.noise_multiplier:g} x seed noise "
                    f"({s.noise:.2%})"
                )
            else:
                notes[name] = (
                    f"held-out loss {s.rel_gap:+.2%} exceeds {gates.max_rel_loss_gap:.2%} but is "
                    f"within {gates.noise_multiplier:g} x seed noise ({s.noise:.2%}): more seeds "
                    "would tell"
                )
        elif not reason and not math.isfinite(s.rel_gap):
            reason = "held-out loss is not finite"
        if reason:
            rejected[name] = reason
        else:
            eligible.append(name)
    recommended = None
    if eligible:
        by_name = {s.policy: s for s in summaries}
        least = min(by_name[n].total_bytes for n in eligible)
        close = [n for n in eligible if by_name[n].total_bytes <= least * 1.02]
        recommended = max(close, key=lambda n: by_name[n].steps_per_s)
    return Decision(
        baseline=contract.baseline,
        baseline_ok=not base_reason,
        baseline_reason=base_reason,
        eligible=tuple(eligible),
        rejected=rejected,
        notes=notes,
        recommended=recommended,
        summaries=tuple(summaries),
    )
