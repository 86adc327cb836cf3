"""The decision: a verdict for every candidate, and which one to recommend.

Pure functions over run records and the contract, so a decision can be tested
on constructed records and re-judged from stored ones. Each candidate gets one
`Verdict`: the first gate it fails rejects it (a failed run, non-finite losses,
skipped steps, an error about its update path, the metric threshold); a run too
short to judge is said so; otherwise its paired loss gap decides: eligible when
the whole confidence interval is within the limit, rejected when all of it is
beyond, inconclusive in between (never eligible). See docs/compare.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mixprec.experiment.contract import Contract, Gates
from mixprec.experiment.records import RunRecord
from mixprec.experiment.summary import (
    PolicySummary,
    format_interval,
    summarize,
    tail_start,
)

__all__ = ["Decision", "Verdict", "VerdictStatus", "decide"]

VerdictStatus = Literal["eligible", "rejected", "inconclusive", "too_short", "not_run"]


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What the gates made of one candidate.

    Attributes:
        status: ``eligible``, ``rejected``, ``inconclusive`` or ``too_short``.
        gate: the gate that decided: ``run``, ``non-finite``, ``skipped``,
            ``update-path``, ``metric``, ``training-length``, ``loss-gap``, or
            ``baseline`` (not judged: the baseline failed).
        reason: one sentence with the figures that decided.
        acknowledged: update-path rules that fired at error severity but are
            listed in the contract's ``allow``.
    """

    status: VerdictStatus
    gate: str
    reason: str
    acknowledged: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "status": self.status,
            "gate": self.gate,
            "reason": self.reason,
            "acknowledged": list(self.acknowledged),
        }


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The verdict of an experiment.

    Attributes:
        baseline: the baseline policy.
        baseline_ok: the baseline passed its own gates (if not, nothing can be judged).
        baseline_reason: why the baseline failed, or empty.
        too_short: why the full-length runs are too short to judge a gap (the
            baseline's figures), or empty; when set, nothing is recommended.
        verdicts: candidate -> its verdict, in contract order.
        recommended: the cheapest eligible candidate by measured memory, then speed;
            None when none is eligible or the runs are too short.
        max_seeds: the seed limit the inconclusive candidates were judged under.
        summaries: per-policy summaries, baseline first.
    """

    baseline: str
    baseline_ok: bool
    baseline_reason: str
    verdicts: Mapping[str, Verdict]
    recommended: str | None
    too_short: str = ""
    max_seeds: int = 0
    summaries: tuple[PolicySummary, ...] = ()

    def _with(self, status: VerdictStatus) -> dict[str, str]:
        return {n: v.reason for n, v in self.verdicts.items() if v.status == status}

    @property
    def eligible(self) -> tuple[str, ...]:
        """Candidates that passed every gate, in contract order."""
        return tuple(self._with("eligible"))

    @property
    def rejected(self) -> dict[str, str]:
        """Candidate -> why it was rejected."""
        return self._with("rejected")

    @property
    def inconclusive(self) -> dict[str, str]:
        """Candidate -> why its gap is not settled (its interval straddles the limit)."""
        return self._with("inconclusive")

    @property
    def not_run(self) -> dict[str, str]:
        """Candidates with no runs yet (an interrupted experiment)."""
        return self._with("not_run")

    @property
    def notes(self) -> dict[str, str]:
        """Candidate -> remarks beside the verdict (acknowledged doctor errors)."""
        return {
            n: "acknowledged (allow): " + ", ".join(v.acknowledged)
            for n, v in self.verdicts.items()
            if v.acknowledged
        }

    @property
    def success(self) -> bool:
        """The baseline passed and a candidate is recommended."""
        return self.baseline_ok and self.recommended is not None

    def summary(self, policy: str) -> PolicySummary:
        """The summary of `policy`."""
        for s in self.summaries:
            if s.policy == policy:
                return s
        raise KeyError(policy)

    def to_dict(self) -> dict[str, Any]:
        """The ``decision`` object of results.json."""
        policies: dict[str, Any] = {}
        for s in self.summaries:
            entry = s.to_dict()
            if s.policy in self.verdicts:
                entry["verdict"] = self.verdicts[s.policy].to_dict()
            policies[s.policy] = entry
        return {
            "baseline": self.baseline,
            "baseline_ok": self.baseline_ok,
            "baseline_reason": self.baseline_reason,
            "too_short": self.too_short,
            "eligible": list(self.eligible),
            "rejected": self.rejected,
            "inconclusive": self.inconclusive,
            "not_run": self.not_run,
            "notes": self.notes,
            "recommended": self.recommended,
            "max_seeds": self.max_seeds,
            "policies": policies,
        }


def _hard_gate(
    s: PolicySummary, gates: Gates, higher_is_better: bool, records: Sequence[RunRecord]
) -> tuple[str, str]:
    """The first hard gate `s` fails, as ``(gate, sentence)``, or ``("", "")``."""
    if s.failed:
        return "run", f"run failed ({s.failed[0]})"
    if s.nonfinite_steps > gates.max_nonfinite_steps:
        return "non-finite", (
            f"{s.nonfinite_steps} non-finite-loss steps > "
            f"max_nonfinite_steps={gates.max_nonfinite_steps}"
        )
    if s.skipped_fraction > gates.max_skipped_fraction:
        return "skipped", (
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
                return "metric", (
                    f"{r.metric_name} {r.metric:.4g} (seed {r.seed}) misses "
                    f"{op} {gates.metric_threshold:g}"
                )
    return "", ""


def _too_short_reason(
    s: PolicySummary, baseline: str, gates: Gates, base: Sequence[RunRecord]
) -> str:
    """Why a comparison at `s.steps` cannot judge a gap yet, or empty."""
    at = s.steps
    losses = [r.heldout_at(at) for r in base]
    if any(v == 0 for v in losses):
        return (
            f"{baseline}'s held-out loss is 0 at step {at}: relative gaps are undefined "
            "(the workload's loss must stay away from 0, e.g. with label noise)"
        )
    if math.isnan(s.improvement) or math.isnan(s.tail_improvement):
        missing = [
            st for st in (0, tail_start(at), at) if any(math.isnan(r.heldout_at(st)) for r in base)
        ]
        return (
            f"no held-out evaluation of {baseline} at step(s) {missing or [at]} to tell "
            "whether it has trained and settled (records of an older mixprec: rerun)"
        )
    if s.improvement < gates.improvement_floor:
        return (
            f"{baseline}'s held-out loss moved {s.improvement:.2%} from its initial weights by "
            f"step {at} (< {gates.improvement_floor:.2%}): it has barely trained, so no gap "
            "means anything yet; check lr and steps"
        )
    if s.tail_improvement > gates.tail_limit:
        return (
            f"{baseline}'s held-out loss still fell {s.tail_improvement:.2%} over steps "
            f"{tail_start(at)}-{at} (> {gates.tail_limit:.2%}): a gap this early measures "
            "pace, not outcome; train longer"
        )
    return ""


def _judge(
    s: PolicySummary,
    contract: Contract,
    higher_is_better: bool,
    records: Sequence[RunRecord],
    base: Sequence[RunRecord],
) -> Verdict:
    gates = contract.gates
    if not s.seeds:  # an interrupted experiment: missing, not rejected
        return Verdict(status="not_run", gate="", reason="not run yet: rerun compare to train it")
    gate, reason = _hard_gate(s, gates, higher_is_better, records)
    if gate:
        return Verdict(status="rejected", gate=gate, reason=reason)
    acknowledged = tuple(r for r in s.update_errors if r in contract.allow)
    blocking = {r: m for r, m in s.update_errors.items() if r not in contract.allow}
    if blocking:
        first, message = next(iter(blocking.items()))
        more = [r for r in blocking if r != first]
        return Verdict(
            status="rejected",
            gate="update-path",
            reason=f"doctor {first} (error): {message}"
            + (f"; also {', '.join(more)} (error)" if more else "")
            + " (acknowledge with allow: [rule-id])",
            acknowledged=acknowledged,
        )
    gap = s.gap
    limit = gates.max_rel_loss_gap
    if gap.n == 0:  # the baseline's runs for these seeds are missing: nothing to judge
        return Verdict(
            status="not_run",
            gate="",
            reason=f"no seed shared with {contract.baseline} to pair with: rerun compare",
        )
    short = _too_short_reason(s, contract.baseline, gates, base)
    if short:
        return Verdict(
            status="too_short", gate="training-length", reason=short, acknowledged=acknowledged
        )
    if not math.isfinite(gap.mean):
        return Verdict(
            status="rejected",
            gate="loss-gap",
            reason="held-out loss is not finite",
            acknowledged=acknowledged,
        )
    settled = (
        f"max_seeds={contract.seed_limit} reached"
        if gap.n >= contract.seed_limit
        else "more seeds needed"
    )
    if gap.n == 1:
        return Verdict(
            status="inconclusive",
            gate="loss-gap",
            reason=f"gap {format_interval(gap)}: no interval from one seed; {settled}",
            acknowledged=acknowledged,
        )
    interval = f"{format_interval(gap)} ({gap.confidence:.0%} t-interval, {gap.n} seeds)"
    if gap.high <= limit:
        return Verdict(
            status="eligible",
            gate="loss-gap",
            reason=f"gap {interval} <= {limit:.2%}",
            acknowledged=acknowledged,
        )
    if gap.low > limit:
        return Verdict(
            status="rejected",
            gate="loss-gap",
            reason=f"gap {interval} > {limit:.2%} on the whole interval",
            acknowledged=acknowledged,
        )
    return Verdict(
        status="inconclusive",
        gate="loss-gap",
        reason=f"gap {interval} straddles {limit:.2%}: {settled}",
        acknowledged=acknowledged,
    )


def decide(records: Sequence[RunRecord], contract: Contract, *, higher_is_better: bool) -> Decision:
    """Judge every candidate against the baseline under the contract's gates.

    The recommendation is the eligible candidate with the least measured memory;
    candidates within 2% of that memory are ordered by throughput. Nothing is
    recommended when the full-length runs are too short to judge.
    """
    gates = contract.gates
    base_records = [r for r in records if r.policy == contract.baseline]
    base_ok = [r for r in base_records if r.ok]
    base = summarize(records, contract.baseline, base_records, confidence=gates.confidence)
    base_gate, base_reason = _hard_gate(base, gates, higher_is_better, records)
    summaries = [base]
    verdicts: dict[str, Verdict] = {}
    for name in contract.candidates:
        s = summarize(records, name, base_records, confidence=gates.confidence)
        summaries.append(s)
        if base_gate:
            verdicts[name] = Verdict(
                status="rejected",
                gate="baseline",
                reason="not judged: the baseline failed its gates",
            )
            continue
        verdicts[name] = _judge(s, contract, higher_is_better, records, base_ok)
    too_short = ""
    if not base_gate:
        too_short = _too_short_reason(base, contract.baseline, gates, base_ok)
    eligible = [n for n, v in verdicts.items() if v.status == "eligible"]
    recommended = None
    if eligible and not too_short:
        by_name = {s.policy: s for s in summaries}
        least = min(by_name[n].total_bytes for n in eligible)
        close = [n for n in eligible if by_name[n].total_bytes <= least * 1.02]
        recommended = max(close, key=lambda n: by_name[n].steps_per_s)
    return Decision(
        baseline=contract.baseline,
        baseline_ok=not base_gate,
        baseline_reason=base_reason,
        verdicts=verdicts,
        recommended=recommended,
        too_short=too_short,
        max_seeds=contract.seed_limit,
        summaries=tuple(summaries),
    )
