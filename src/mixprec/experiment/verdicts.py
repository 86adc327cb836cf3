"""The gates that judge one candidate, and the verdict they give.

A candidate's first failed gate rejects it: a failed run, non-finite losses,
skipped steps, the metric threshold, an error about its update path, the
contract's memory budget or slowdown limit. A run too short to judge is said
so; otherwise its paired loss gap decides (`gap_verdict`). `decide` applies
these to every candidate; the FP8 gate (`mixprec.experiment.fp8_gate`) applies
`gap_verdict` once more, against the best 16-bit policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mixprec.experiment.contract import MAX_SEEDS, Contract, format_bytes
from mixprec.experiment.gates import Gates
from mixprec.experiment.records import RunRecord
from mixprec.experiment.stats import GapInterval, seeds_to_decide
from mixprec.experiment.summary import PolicySummary, format_interval, tail_start

__all__ = [
    "Verdict",
    "VerdictStatus",
    "gap_verdict",
    "hard_gate",
    "judge",
    "too_short_reason",
]

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
        decide_with: for a verdict that does not decide (``inconclusive``,
            ``too_short``), contract settings a rerun into the same folder can take
            to decide, by contract key (``{"max_seeds": 9}``, ``{"steps": 1200}``);
            each alone is enough (as far as the data so far can tell). Empty
            otherwise.
    """

    status: VerdictStatus
    gate: str
    reason: str
    acknowledged: tuple[str, ...] = ()
    decide_with: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "status": self.status,
            "gate": self.gate,
            "reason": self.reason,
            "acknowledged": list(self.acknowledged),
            "decide_with": dict(self.decide_with),
        }


def hard_gate(
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


def too_short_reason(
    s: PolicySummary,
    baseline: str,
    gates: Gates,
    base: Sequence[RunRecord],
    *,
    stands_for: int | None = None,
) -> tuple[str, dict[str, Any]]:
    """Why a comparison at `s.steps` cannot judge a gap, or ``""``, and the settings
    that would let it (``{"steps": 1200}``; empty when no setting would).

    `stands_for` is the length of the training run the experiment stands for (the
    workload's own `TrainSettings.steps`; None: not known). A comparison after the
    whole of that schedule measures the schedule's outcome, converged or not; one
    that stops earlier (a shorter schedule, or a capped run) while the baseline
    still improves quickly measures pace, and is too short.
    """
    at = s.steps
    losses = [r.heldout_at(at) for r in base]
    if any(v == 0 for v in losses):
        return (
            f"{baseline}'s held-out loss is 0 at step {at}: relative gaps are undefined "
            "(the workload's loss must stay away from 0, e.g. with label noise)"
        ), {}
    if math.isnan(s.improvement) or math.isnan(s.tail_improvement):
        missing = [
            st for st in (0, tail_start(at), at) if any(math.isnan(r.heldout_at(st)) for r in base)
        ]
        return (
            f"no held-out evaluation of {baseline} at step(s) {missing or [at]} to tell "
            "whether it has trained and settled (records of an older mixprec: rerun)"
        ), {}
    if s.improvement < gates.improvement_floor:
        return (
            f"{baseline}'s held-out loss moved {s.improvement:.2%} from its initial weights by "
            f"step {at} (< {gates.improvement_floor:.2%}): it has barely trained, so no gap "
            "means anything yet; check lr and steps, or lower gates.min_improvement for a "
            "run that starts near its final loss"
        ), {}
    schedule = max((r.schedule_steps or r.steps for r in base), default=at)
    whole = stands_for is not None and at >= schedule >= stands_for
    if whole or s.tail_improvement <= gates.tail_limit:
        return "", {}
    still = (
        f"{baseline}'s held-out loss still fell {s.tail_improvement:.2%} over steps "
        f"{tail_start(at)}-{at} (> {gates.tail_limit:.2%}): a gap this early measures pace, "
        "not outcome"
    )
    if at < schedule:
        return (
            f"{s.policy} stopped at step {at} of the {schedule}-step schedule (step_caps) and "
            f"{still}; step_caps: {{}} runs it in full (slow where fp16 is emulated)"
        ), {"step_caps": {}}
    if stands_for is None:
        return f"{still}; train longer", {}
    return (
        f"the runs covered {schedule} of the {stands_for} steps of the workload's schedule, "
        f"and {still}; --steps {stands_for} (the whole schedule) decides"
    ), {"steps": stands_for}


def _storage_hint(policy: str, records: Sequence[RunRecord]) -> str:
    for r in records:
        if r.policy == policy and r.policy_fields.get("param_dtype") == "fp32":
            return " (fp32 storage: its parameters, gradients and moments are the baseline's)"
    return ""


def _cost_gate(
    s: PolicySummary,
    contract: Contract,
    base: PolicySummary,
    speed_usable: bool,
    records: Sequence[RunRecord],
) -> tuple[str, str]:
    """The budget `s` breaks, as ``(gate, sentence)``, or ``("", "")``. The slowdown
    limit is judged only on speed figures that hold (`speed_usable`)."""
    budget = contract.memory_budget
    if budget is not None:
        if not math.isfinite(s.max_bytes):
            return "memory-budget", "no memory measured: memory_budget cannot be checked"
        if s.max_bytes > budget:
            return "memory-budget", (
                f"measured {format_bytes(s.max_bytes)}, {format_bytes(s.max_bytes - budget)} "
                f"over memory_budget {format_bytes(budget)}{_storage_hint(s.policy, records)}"
            )
    limit = contract.max_slowdown
    if limit is not None and speed_usable:
        ratio = s.time_ratio
        if not math.isfinite(ratio.mean):
            return "slowdown", "no step time measured: max_slowdown cannot be checked"
        if ratio.mean > limit:
            # Enough digits that the figure visibly exceeds the limit (1.194 > 1.19).
            digits = 2 if f"{ratio.mean:.2f}" != f"{limit:.2f}" else 4
            mine, theirs = _paired_speeds(s, base.policy, records)
            return "slowdown", (
                f"step time {ratio.mean:.{digits}f}x {contract.baseline}'s (mean of "
                f"{len(ratio.values)} paired seeds, {ratio.low:.2f}-{ratio.high:.2f}; "
                f"{mine:.1f} vs {theirs:.1f} steps/s on those seeds) > max_slowdown {limit:g}"
            )
    return "", ""


def _paired_speeds(
    s: PolicySummary, baseline: str, records: Sequence[RunRecord]
) -> tuple[float, float]:
    """Mean steps/s of `s` and of the baseline over the seeds both ran (the seeds
    its step-time ratio is paired on)."""
    ok = {(r.policy, r.seed): r for r in records if r.ok}
    seeds = [k for k in s.seeds if (s.policy, k) in ok and (baseline, k) in ok]

    def speed(policy: str) -> float:
        values = [float(ok[policy, k].throughput.get("steps_per_s", math.nan)) for k in seeds]
        return sum(values) / len(values) if values else math.nan

    return speed(s.policy), speed(baseline)


def judge(
    s: PolicySummary,
    contract: Contract,
    higher_is_better: bool,
    records: Sequence[RunRecord],
    base: Sequence[RunRecord],
    base_summary: PolicySummary,
    speed_usable: bool,
    *,
    stands_for: int | None = None,
) -> Verdict:
    """The verdict of candidate `s` (see the module docstring); `stands_for` is the
    length of the run the experiment stands for (`too_short_reason`)."""
    gates = contract.gates
    if not s.seeds:  # an interrupted experiment: missing, not rejected
        return Verdict(status="not_run", gate="", reason="not run yet: rerun compare to train it")
    gate, reason = hard_gate(s, gates, higher_is_better, records)
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
    # Before the loss gap: a policy over a budget needs no more seeds to be refused.
    gate, reason = _cost_gate(s, contract, base_summary, speed_usable, records)
    if gate:
        return Verdict(status="rejected", gate=gate, reason=reason, acknowledged=acknowledged)
    gap = s.gap
    if gap.n == 0:  # the baseline's runs for these seeds are missing: nothing to judge
        return Verdict(
            status="not_run",
            gate="",
            reason=f"no seed shared with {contract.baseline} to pair with: rerun compare",
        )
    short, decide_with = too_short_reason(s, contract.baseline, gates, base, stands_for=stands_for)
    if short:
        return Verdict(
            status="too_short",
            gate="training-length",
            reason=short,
            acknowledged=acknowledged,
            decide_with=decide_with,
        )
    return gap_verdict(
        gap,
        gates.max_rel_loss_gap,
        seed_limit=contract.seed_limit,
        acknowledged=acknowledged,
    )


def gap_verdict(
    gap: GapInterval,
    limit: float,
    *,
    seed_limit: int,
    acknowledged: tuple[str, ...] = (),
    gate: str = "loss-gap",
    against: str = "",
) -> Verdict:
    """The verdict of a paired gap's interval against `limit`, one look at a fixed count.

    Rejected, at any number of seeds, when the whole interval is beyond `limit`;
    eligible only once `seed_limit` (``max_seeds``) seeds or more are paired and the
    whole interval is within it; inconclusive otherwise. Calling a candidate
    eligible at one count only keeps the interval's one-sided error rate, however
    many times seeds were added before (a rejection never makes a candidate
    eligible: stopping for it only lowers that rate). An inconclusive verdict at
    `seed_limit` says what would decide (`Verdict.decide_with`). `against` names the
    reference when it is not the baseline.
    """
    to = f" to {against}" if against else ""
    if not math.isfinite(gap.mean):
        return Verdict(
            status="rejected",
            gate=gate,
            reason="held-out loss is not finite",
            acknowledged=acknowledged,
        )
    if gap.n == 1:
        more = "more seeds needed" if seed_limit > 1 else "--max-seeds 2 at least decides"
        return Verdict(
            status="inconclusive",
            gate=gate,
            reason=f"gap{to} {format_interval(gap)}: no interval from one seed; {more}",
            acknowledged=acknowledged,
            decide_with={} if seed_limit > 1 else {"max_seeds": 2},
        )
    interval = f"{format_interval(gap)} ({gap.confidence:.0%} t-interval, {gap.n} seeds)"
    if gap.low > limit:
        return Verdict(
            status="rejected",
            gate=gate,
            reason=f"gap{to} {interval} > {limit:.2%} on the whole interval",
            acknowledged=acknowledged,
        )
    if gap.n < seed_limit:
        return Verdict(
            status="inconclusive",
            gate=gate,
            reason=f"gap{to} {interval}: more seeds needed (eligibility is judged once, at "
            f"max_seeds={seed_limit})",
            acknowledged=acknowledged,
        )
    if gap.high <= limit:
        return Verdict(
            status="eligible",
            gate=gate,
            reason=f"gap{to} {interval} <= {limit:.2%}",
            acknowledged=acknowledged,
        )
    seeds = seeds_to_decide(gap, limit, most=MAX_SEEDS)
    supported = math.ceil(gap.high * 1e4) / 1e4  # 0.01% steps, never below the bound
    options: dict[str, Any] = {}
    if seeds is not None:
        options["max_seeds"] = seeds
    options["max_rel_loss_gap"] = supported
    if seeds is None:
        more = f"no seed count up to {MAX_SEEDS} would settle it at this mean and spread"
    else:
        side = "decide" if gap.mean < limit else "reject it"
        more = f"--max-seeds {seeds} would likely {side} (if the gaps keep their mean and spread)"
    return Verdict(
        status="inconclusive",
        gate=gate,
        reason=f"gap{to} {interval} straddles {limit:.2%} at max_seeds={seed_limit}: {more}; "
        f"the data support a limit of {supported:.2%} (--max-rel-loss-gap {supported:g})",
        acknowledged=acknowledged,
        decide_with=options,
    )
