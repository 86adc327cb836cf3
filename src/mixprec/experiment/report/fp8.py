"""The report's FP8 section: each FP8 candidate against its 16-bit reference, by how much a
failing recipe fails, and which layers' casts saturate or underflow.

Read from the decision (the verdicts and the reference), the records' FP8 traces
(`mixprec.experiment.fp8_trace`) and the doctor's ``fp8-saturation`` and
``fp8-underflow`` findings stored in each record, so `mixprec report DIR` writes
the same section from stored runs. `worst_tensors` is shared with the FP8 plot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixprec.experiment.decision import Decision
from mixprec.experiment.fp8_gate import FP8_GATE, SPEED_PENDING, fp8_policies, unconverted_fp8
from mixprec.experiment.fp8_trace import Fp8TensorTrace
from mixprec.experiment.records import RunRecord
from mixprec.experiment.stats import GapInterval
from mixprec.experiment.summary import format_interval, summarize

__all__ = [
    "FP8_HEADING",
    "FP8_RULES",
    "TensorPeaks",
    "fp8_lines",
    "fp8_records",
    "worst_tensors",
]

FP8_HEADING = "FP8"

#: The doctor's rules about what fp8 casts do to values, quoted in the section.
FP8_RULES = ("fp8-saturation", "fp8-underflow")

#: Tensors listed per FP8 policy.
_LISTED = 3

#: Kept layers listed for an FP8 policy that converted none.
_KEPT_LISTED = 4


def fp8_records(records: Sequence[RunRecord], decision: Decision) -> dict[str, list[RunRecord]]:
    """The finished runs of each FP8 candidate, in decision order (seed order within)."""
    names = fp8_policies(records, [s.policy for s in decision.summaries])
    return {
        name: sorted((r for r in records if r.policy == name and r.ok), key=lambda r: r.seed)
        for name in names
    }


@dataclass(frozen=True, kw_only=True)
class TensorPeaks:
    """One fp8 tensor of a policy over its seeds' traces.

    Attributes:
        label: ``layer (role)``.
        format: its fp8 format.
        seeds: seeds whose trace holds it in full.
        saturated: the largest saturated fraction over steps and seeds.
        underflow: the largest underflow fraction over steps and seeds.
        mean_underflow: the mean underflow fraction over its sampled steps and seeds.
        delayed_saturated: the what-if's largest saturated fraction (NaN: never computed).
        amax_low, amax_high: its amax range over the sampled steps and seeds.
    """

    label: str
    format: str
    seeds: tuple[int, ...]
    saturated: float
    underflow: float
    mean_underflow: float
    delayed_saturated: float
    amax_low: float
    amax_high: float


def _finite_max(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def worst_tensors(runs: Sequence[RunRecord], limit: int = _LISTED) -> list[TensorPeaks]:
    """The `limit` worst tensors kept in full by `runs`' traces, merged over seeds: by the
    larger of peak saturated and peak underflow fraction, then the what-if's peak."""
    by_label: dict[str, list[tuple[int, Fp8TensorTrace]]] = {}
    for r in runs:
        if r.fp8_trace is None:
            continue
        for t in r.fp8_trace.worst:
            by_label.setdefault(t.label, []).append((r.seed, t))
    peaks = []
    for label, items in by_label.items():
        traces = [t for _, t in items]
        under = [u for t in traces for u in t.underflow]
        amax = [a for t in traces for a in t.amax if math.isfinite(a)]
        peaks.append(
            TensorPeaks(
                label=label,
                format=traces[0].format,
                seeds=tuple(seed for seed, _ in items),
                saturated=max(t.peak_saturated for t in traces),
                underflow=max(t.peak_underflow for t in traces),
                mean_underflow=sum(under) / len(under) if under else math.nan,
                delayed_saturated=_finite_max([t.peak_delayed_saturated for t in traces]),
                amax_low=min(amax, default=math.nan),
                amax_high=max(amax, default=math.nan),
            )
        )

    def key(p: TensorPeaks) -> tuple[float, float]:
        delayed = p.delayed_saturated if math.isfinite(p.delayed_saturated) else 0.0
        return (max(p.saturated, p.underflow), delayed)

    return sorted(peaks, key=key, reverse=True)[:limit]


def _points(value: float) -> str:
    return f"{100 * value:.2f} points"


def _side(value: float, limit: float) -> str:
    """``0.08 points over`` / ``0.42 points under`` / ``at``: `value` against `limit`."""
    if value == limit:
        return "at"
    return f"{_points(abs(value - limit))} {'over' if value > limit else 'under'}"


def _by_how_much(gap: GapInterval, limit: float, status: str) -> str:
    """How far a gap's interval is from the limit, in percentage points, for a verdict that
    is not eligible: the low end when rejected, both ends when the interval straddles the
    limit, the mean alone (and no interval) with one seed."""
    if not math.isfinite(gap.mean):
        return "its held-out loss is not finite"
    if gap.n < 2 or not (math.isfinite(gap.low) and math.isfinite(gap.high)):
        return (
            f"one seed gives no interval: its gap {gap.mean:+.2%} is {_side(gap.mean, limit)} "
            f"the {limit:.2%} limit; more seeds decide"
        )
    if status == "rejected" and gap.low > limit:
        return (
            f"fails by {_points(gap.low - limit)}: even the interval's low end {gap.low:+.2%} is "
            f"over the {limit:.2%} limit (mean {gap.mean:+.2%}, {_side(gap.mean, limit)})"
        )
    return (
        f"its {gap.confidence:.0%} t-interval straddles the {limit:.2%} limit: the high end "
        f"{gap.high:+.2%} is {_side(gap.high, limit)} it, the low end {gap.low:+.2%} "
        f"{_side(gap.low, limit)} (mean {gap.mean:+.2%})"
    )


def _candidate_line(
    name: str, records: Sequence[RunRecord], decision: Decision, limit: float, confidence: float
) -> str:
    v = decision.verdicts.get(name)
    if v is None:
        return f"`{name}`: not judged"
    ref = decision.fp8_reference
    against_ref = ""
    gap_ref: GapInterval | None = None
    if ref is not None:
        ref_runs = [r for r in records if r.policy == ref]
        gap_ref = summarize(records, name, ref_runs, confidence=confidence).gap
        if gap_ref.n == 1:
            against_ref = f"gap to `{ref}` {format_interval(gap_ref)}"
        elif gap_ref.n:
            against_ref = (
                f"gap to `{ref}` {format_interval(gap_ref)} ({gap_ref.confidence:.0%} "
                f"t-interval, {gap_ref.n} seeds, sd {gap_ref.sd:.2%} over seeds)"
            )
    base_gap = decision.summary(name).gap if name in decision.verdicts else None
    against_base = (
        f"to `{decision.baseline}` {format_interval(base_gap)}"
        if base_gap is not None and base_gap.n
        else ""
    )
    gaps = "; ".join(g for g in (against_ref, against_base) if g) or "no paired gap"
    status = v.status + (f" ({v.gate})" if v.status == "rejected" else "")
    if v.status == "eligible" and name in decision.speed_pending:
        status += f", {SPEED_PENDING}"
    line = f"`{name}`: {gaps}: **{status}**"
    if v.status in ("rejected", "inconclusive"):
        if v.gate == FP8_GATE and gap_ref is not None and gap_ref.n:
            line += f"; against `{ref}`: {_by_how_much(gap_ref, limit, v.status)}"
        elif v.gate == "loss-gap" and base_gap is not None and base_gap.n:
            line += f"; against `{decision.baseline}`: {_by_how_much(base_gap, limit, v.status)}"
        else:
            line += f": {v.reason}"
    return line


def _tensor_line(name: str, runs: Sequence[RunRecord]) -> str | None:
    traced = [r for r in runs if r.fp8_trace is not None]
    if not traced:
        return None
    worst = worst_tensors(traced)
    if not worst:
        return None
    samples = max(r.fp8_trace.samples for r in traced if r.fp8_trace is not None)
    layers = max(r.fp8_trace.layers for r in traced if r.fp8_trace is not None)
    parts = []
    for p in worst:
        delayed = (
            f", delayed-scaling what-if would clip up to {p.delayed_saturated:.2%}"
            if math.isfinite(p.delayed_saturated)
            else ""
        )
        parts.append(
            f"{p.label}, {p.format}: underflow up to {p.underflow:.3%} (mean "
            f"{p.mean_underflow:.3%}) of non-zero elements, saturated up to {p.saturated:.3%}"
            f"{delayed}; amax {p.amax_low:.3g} to {p.amax_high:.3g}"
        )
    return (
        f"`{name}` worst fp8 tensors ({layers} fp8 layers, {samples} sampled steps, "
        f"{len(traced)} seed(s)): " + "; ".join(parts)
    )


def _kept(runs: Sequence[RunRecord]) -> str:
    """The layers the fp8 filter kept, with their reasons, from the first record that lists
    them (empty when none is recorded)."""
    for r in runs:
        fp8 = r.effective.get("fp8")
        kept = fp8.get("kept") if isinstance(fp8, Mapping) else None
        if not isinstance(kept, list) or not kept:
            continue
        parts = [
            f"{k.get('name') or '<model>'}: {k.get('reason', '?')}"
            for k in kept[:_KEPT_LISTED]
            if isinstance(k, Mapping)
        ]
        more = f"; ... ({len(kept) - _KEPT_LISTED} more)" if len(kept) > _KEPT_LISTED else ""
        return f" (kept {'; '.join(parts)}{more})"
    return ""


def _unconverted_line(name: str, runs: Sequence[RunRecord]) -> str:
    return (
        f"`{name}` converted no layer: its fp8 filter kept every nn.Linear in 16 bits"
        f"{_kept(runs)}, so it trained entirely in 16 bits: its losses and step times are "
        "its 16-bit policy's, not FP8's; fix: relax the fp8 filter (min_divisor, "
        "skip_first_last, exclude) so the model's linears convert, or compare a 16-bit policy"
    )


def _finding_line(name: str, runs: Sequence[RunRecord]) -> list[str]:
    """The doctor's fp8 findings of `name`, the largest fraction of each rule over seeds."""
    best: dict[str, tuple[float, int, Mapping[str, Any]]] = {}
    for r in runs:
        for f in r.doctor:
            rule = str(f.get("rule", ""))
            if rule not in FP8_RULES:
                continue
            ev = f.get("evidence")
            frac = float(ev.get("fraction", 0.0)) if isinstance(ev, Mapping) else 0.0
            if rule not in best or frac > best[rule][0]:
                best[rule] = (frac, r.seed, f)
    lines = []
    for rule in FP8_RULES:
        if rule not in best:
            continue
        frac, seed, f = best[rule]
        ev = f.get("evidence")
        ev = ev if isinstance(ev, Mapping) else {}
        what = "what-if" if ev.get("measured") is False else "measured"
        seen = ev.get("times_seen")
        steps = (
            f", steps {ev.get('first_step')}-{ev.get('last_step')} ({seen} samples over the "
            "threshold)"
            if seen is not None
            else ""
        )
        lines.append(
            f"doctor `{rule}` ({f.get('severity', 'info')}, {what}) on `{name}` seed {seed}: "
            f"{f.get('where', '')}, {frac:.2%} at step {ev.get('step', '?')} (threshold "
            f"{float(ev.get('threshold', math.nan)):.2%}){steps}"
        )
    if not lines and runs:
        lines.append(
            f"doctor on `{name}`: no fp8-saturation or fp8-underflow finding on any seed "
            "(every sampled cast under its thresholds)"
        )
    return lines


def fp8_lines(
    records: Sequence[RunRecord], decision: Decision, *, limit: float, confidence: float
) -> tuple[str, ...]:
    """The FP8 section, one statement per line (empty when no FP8 candidate ran).

    Args:
        records: the run records.
        decision: the decision over them.
        limit: the gap limit (``max_rel_loss_gap``).
        confidence: the gap interval's confidence.
    """
    runs = fp8_records(records, decision)
    if not runs:
        return ()
    if decision.fp8_reference is not None:
        lines = [
            f"FP8 candidates are judged against `{decision.baseline}` and the 16-bit "
            f"`{decision.fp8_reference}` (gate {FP8_GATE}): each paired held-out gap must keep "
            f"its {confidence:.0%} t-interval at or below {limit:.2%}"
        ]
    else:
        lines = [f"FP8 candidates had no 16-bit reference: {decision.fp8_note or 'not judged'}"]
    lines += [_candidate_line(n, records, decision, limit, confidence) for n in runs]
    emulated = [n for n in runs if n in decision.emulated]
    if emulated:
        lines.append(
            f"{', '.join(f'`{n}`' for n in emulated)} ran emulated (torchao float8 on a device "
            "without FP8 units): the losses and the casts are FP8's, the step times are the "
            "emulation's, not FP8 speed"
        )
    unconverted = unconverted_fp8(records, list(runs))
    for name, mine in runs.items():
        if name in unconverted:
            lines.append(_unconverted_line(name, mine))
            continue
        line = _tensor_line(name, mine)
        if line is not None:
            lines.append(line)
        elif mine:
            lines.append(
                f"`{name}`: no FP8 trace stored (records of an earlier mixprec, or no fp8 layer "
                "sampled): rerun into a fresh --out for the per-layer figures"
            )
        lines += _finding_line(name, mine)
    return tuple(lines)
