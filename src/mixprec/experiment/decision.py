"""The decision: a verdict for every candidate, and which policy to recommend.

Pure functions over run records and the contract, so a decision can be tested
on constructed records and re-judged from stored ones. Each candidate gets one
`Verdict`: the first gate it fails rejects it (a failed run, non-finite losses,
skipped steps, the metric threshold, an error about its update path, the
contract's memory budget or slowdown limit); a run too short to judge is said
so; otherwise its paired loss gap decides: eligible when the whole confidence
interval is within the limit, rejected when all of it is beyond, inconclusive
in between (never eligible).

The recommendation is then made among the baseline and the eligible candidates
by the contract's objective (`rank`): least memory, shortest step time, or the
least product of the two relative to the baseline. When the runs were not
measured on the contract's `target_device`, nothing is promoted: the decision
is pending a run on the target. FP8 candidates that ran emulated keep their
quality verdict, but their step times measure emulation: ``max_slowdown`` does
not judge them, and under ``speed`` or ``balanced`` they are left out of the
ranking, speed pending a run on FP8 hardware. See docs/compare.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mixprec.experiment.contract import Contract, format_bytes
from mixprec.experiment.fp8_gate import (
    SPEED_PENDING,
    emulated_fp8,
    fp8_policies,
    judge_fp8,
    reference_for_fp8,
)
from mixprec.experiment.hardware import DeviceFacts, distinct, matches_target
from mixprec.experiment.ranking import Standing, rank, steadiness
from mixprec.experiment.records import RunRecord
from mixprec.experiment.summary import PolicySummary, summarize
from mixprec.experiment.verdicts import (
    Verdict,
    VerdictStatus,
    hard_gate,
    judge,
    too_short_reason,
)

__all__ = [
    "Decision",
    "DecisionStatus",
    "Verdict",
    "VerdictStatus",
    "decide",
    "missing_runs",
]


#: ``recommended``: a candidate is recommended; ``stay``: the baseline is (no candidate
#: beats it under the objective); ``pending_target``: candidates pass the gates, but
#: the runs were not measured on the contract's target device; ``none``: nothing can
#: be recommended (the baseline failed, the runs are too short, no candidate is
#: eligible, or the figures the objective needs are not comparable).
DecisionStatus = Literal["recommended", "stay", "pending_target", "none"]


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
        recommended: the policy to promote: the first of `ranking` (a candidate, or
            the baseline: stay); None when `status` is ``pending_target`` or ``none``.
        max_seeds: the seed limit the inconclusive candidates were judged under.
        summaries: per-policy summaries, baseline first.
        status: see `DecisionStatus`.
        objective: the contract's objective.
        ranking: the baseline (unless it breaks a budget) and the eligible
            candidates, best first under `ranked_by`.
        ranked_by: the objective `ranking` follows: the contract's, or ``memory``
            when the step times do not hold (pending a target, several setups).
        pending: why the runs do not decide for the target device (they were
            measured elsewhere), or empty.
        speed_note: why the speed figures were not used (measured off the target,
            or on more than one machine), or empty.
        baseline_note: why the baseline cannot be the recommendation (a budget it
            breaks), or empty.
        hardware: the different hardware the runs were measured on (None: a record
            that did not say), in record order.
        target_device: the contract's target device, or None.
        memory_budget: the contract's memory budget in bytes, or None.
        max_slowdown: the contract's slowdown limit, or None.
        fp8_reference: the 16-bit policy the FP8 candidates were judged against
            (`mixprec.experiment.fp8_gate`), or None (no FP8 candidate, or no
            eligible 16-bit one: then `fp8_note` says why).
        fp8_note: why the FP8 candidates had no 16-bit reference, or empty.
        incomplete: the runs of the contract's seeds that have no record (an
            interrupted experiment re-judged by `mixprec report`), or empty; when
            set, nothing is recommended (the missing runs could change the choice).
        speed_pending: eligible FP8 candidates left out of a ranking on step time
            (objective ``speed`` or ``balanced``) because they ran emulated: their
            step times measure numerics, not FP8 speed (`fp8_gate.SPEED_PENDING`).
        emulated: the FP8 candidates that ran emulated (whatever the objective);
            ``max_slowdown`` does not judge them.
        decide_with: contract settings a rerun into the same folder can take to decide
            what this decision leaves open (the whole run too short, inconclusive or
            too-short candidates): ``steps``, ``max_seeds`` (the most any candidate
            needs) with ``candidates`` (the open ones, when others are settled: a
            larger max_seeds is one look for every candidate in the contract),
            ``step_caps``; empty when nothing is open or no setting would help.
        optimizer: the optimizer every run trained with, as reports name it
            (``sgd (momentum=0.9)``; `Contract.optimizer_label`).
        unsteady: why the step times cannot choose (their per-seed ranges overlap
            enough that another draw of the same runs would choose differently), or
            empty. When set, a candidate is promoted over the baseline only if it
            wins at the slowest of its seeds' step-time ratios.
    """

    baseline: str
    baseline_ok: bool
    baseline_reason: str
    verdicts: Mapping[str, Verdict]
    recommended: str | None
    too_short: str = ""
    max_seeds: int = 0
    summaries: tuple[PolicySummary, ...] = ()
    status: DecisionStatus = "none"
    objective: str = "balanced"
    ranking: tuple[Standing, ...] = ()
    ranked_by: str = "balanced"
    pending: str = ""
    speed_note: str = ""
    baseline_note: str = ""
    hardware: tuple[DeviceFacts | None, ...] = ()
    target_device: str | None = None
    memory_budget: int | None = None
    max_slowdown: float | None = None
    fp8_reference: str | None = None
    fp8_note: str = ""
    incomplete: str = ""
    speed_pending: tuple[str, ...] = ()
    emulated: tuple[str, ...] = ()
    decide_with: Mapping[str, Any] = field(default_factory=dict)
    unsteady: str = ""
    optimizer: str = "adamw"

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
        """Candidate -> remarks beside the verdict (acknowledged doctor errors; speed
        pending FP8 hardware)."""
        notes: dict[str, list[str]] = {}
        for n, v in self.verdicts.items():
            if v.acknowledged:
                notes.setdefault(n, []).append("acknowledged (allow): " + ", ".join(v.acknowledged))
            if n in self.speed_pending:
                notes.setdefault(n, []).append(
                    f"{SPEED_PENDING}: its step times were measured under torchao's FP8 "
                    "emulation, which measures numerics, not speed; not ranked on them"
                )
        return {n: "; ".join(parts) for n, parts in notes.items()}

    @property
    def success(self) -> bool:
        """A policy is recommended: a candidate, or the baseline (stay on it). Not
        when nothing is, nor when promotion is pending a run on the target."""
        return self.status in ("recommended", "stay")

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
            "status": self.status,
            "objective": self.objective,
            "optimizer": self.optimizer,
            "memory_budget": self.memory_budget,
            "max_slowdown": self.max_slowdown,
            "fp8_reference": self.fp8_reference,
            "fp8_note": self.fp8_note,
            "incomplete": self.incomplete,
            "speed_pending": list(self.speed_pending),
            "emulated": list(self.emulated),
            "decide_with": dict(self.decide_with),
            "unsteady": self.unsteady,
            "target_device": self.target_device,
            "pending": self.pending,
            "speed_note": self.speed_note,
            "baseline_note": self.baseline_note,
            "ranking": [st.to_dict() for st in self.ranking],
            "ranked_by": self.ranked_by,
            "hardware": [None if h is None else h.to_dict() for h in self.hardware],
            "max_seeds": self.max_seeds,
            "policies": policies,
        }


def _label(h: DeviceFacts | None) -> str:
    return "hardware not recorded" if h is None else h.label


def _pending(target: str | None, hardware: Sequence[DeviceFacts | None]) -> str:
    """Why runs on `hardware` do not decide for `target`, or empty."""
    if target is None:
        return ""
    off = [h for h in hardware if h is None or not matches_target(h, target)]
    if not off:
        return ""
    return (
        f"measured on {', '.join(_label(h) for h in off)}, not on the target {target}: the "
        f"quality evidence holds, the speed evidence does not transfer; rerun this contract "
        f"on {target} before promoting"
    )


def _speed_note(pending: bool, target: str | None, hardware: Sequence[DeviceFacts | None]) -> str:
    """Why the step times cannot rank policies here, or empty."""
    if pending:
        return (
            f"step times measured on {', '.join(_label(h) for h in hardware)} do not transfer "
            f"to {target}"
        )
    if len(hardware) > 1:
        return (
            f"the runs were measured on {len(hardware)} different setups "
            f"({'; '.join(h.key if h else 'not recorded' for h in hardware)}): their step "
            "times are not comparable; rerun into a fresh --out"
        )
    return ""


def _baseline_note(base: PolicySummary, contract: Contract, speed_usable: bool) -> str:
    """Why the baseline cannot be the recommendation (a budget it breaks), or empty."""
    budget = contract.memory_budget
    if budget is not None and not base.max_bytes <= budget:
        return (
            f"{base.policy} itself measured {format_bytes(base.max_bytes)}, "
            f"{format_bytes(base.max_bytes - budget)} over memory_budget "
            f"{format_bytes(budget)}: it cannot be the recommendation"
        )
    limit = contract.max_slowdown
    if limit is not None and speed_usable and limit < 1:
        return f"max_slowdown {limit:.2f} < 1 asks for a policy faster than {base.policy}"
    return ""


def decide(
    records: Sequence[RunRecord],
    contract: Contract,
    *,
    higher_is_better: bool,
    stands_for: int | None = None,
) -> Decision:
    """Judge every candidate against the baseline under the contract's gates and
    budgets, and recommend by its objective.

    The recommendation is the first of `rank` over the baseline (unless it breaks a
    budget) and the eligible candidates: with ``objective: speed`` the fastest (the
    baseline when none is faster), with ``memory`` the smallest, with ``balanced``
    the least product of memory and step time relative to the baseline. Nothing is
    recommended when the baseline fails, the full-length runs are too short, no
    candidate is eligible, the step times the objective needs are not comparable,
    or the runs were measured off the contract's target device (then the status is
    ``pending_target`` and `ranking` orders the contenders by memory alone). Eligible
    FP8 candidates that ran emulated are left out of a ranking on step time
    (`Decision.speed_pending`); under ``memory`` they rank as usual.
    """
    gates = contract.gates
    base_records = [r for r in records if r.policy == contract.baseline]
    base_ok = [r for r in base_records if r.ok]
    base = summarize(records, contract.baseline, base_records, confidence=gates.confidence)
    base_gate, base_reason = hard_gate(base, gates, higher_is_better, records)
    measured = [r for r in records if r.ok and r.policy in contract.policies]
    hardware = tuple(distinct([r.device for r in measured]))
    pending = _pending(contract.target_device, hardware)
    speed_note = _speed_note(bool(pending), contract.target_device, hardware)
    summaries = [base]
    verdicts: dict[str, Verdict] = {}
    # Emulated FP8 step times measure torchao's emulation: max_slowdown does not judge them.
    emulated = emulated_fp8(records, contract.candidates)
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
        verdicts[name] = judge(
            s,
            contract,
            higher_is_better,
            records,
            base_ok,
            base,
            not speed_note and name not in emulated,
            stands_for=stands_for,
        )
    fp8 = fp8_policies(records, contract.candidates)
    fp8_reference, fp8_note = None, ""
    if fp8 and not base_gate:
        by_name = {s.policy: s for s in summaries}
        sixteen = [by_name[n] for n in contract.candidates if n not in fp8]
        ranked_16bit = rank(
            [st for st in sixteen if verdicts[st.policy].status == "eligible"],
            "memory"
            if pending or (speed_note and contract.objective != "memory")
            else contract.objective,
            contract.baseline,
        )
        fp8_reference, fp8_note = reference_for_fp8(
            contract, verdicts, [st.policy for st in ranked_16bit], fp8
        )
        for name in fp8:
            verdicts[name] = judge_fp8(
                name, verdicts[name], records, fp8_reference, fp8_note, contract
            )
    too_short = ""
    baseline_note = ""
    decide_with: dict[str, Any] = {}
    if not base_gate:
        too_short, decide_with = too_short_reason(
            base, contract.baseline, gates, base_ok, stands_for=stands_for
        )
        baseline_note = _baseline_note(base, contract, not speed_note)
    eligible = [n for n, v in verdicts.items() if v.status == "eligible"]
    status: DecisionStatus = "none"
    recommended = None
    ranking: tuple[Standing, ...] = ()
    ranked_by = contract.objective
    speed_pending: tuple[str, ...] = ()
    unsteady = ""
    # With no eligible candidate the baseline is the answer, when it keeps the budgets.
    if not base_gate and not too_short and (eligible or not baseline_note):
        by_name = {s.policy: s for s in summaries}
        by_memory = bool(pending or (speed_note and contract.objective != "memory"))
        if contract.objective != "memory" and not by_memory:
            # Eligible on quality; their speed needs FP8 hardware: not ranked on step time.
            speed_pending = tuple(n for n in eligible if n in emulated)
        ranked = [n for n in eligible if n not in speed_pending]
        contenders = ([] if baseline_note else [base]) + [by_name[n] for n in ranked]
        if by_memory and ranked:
            # Only memory figures hold here: order by them, promote nothing.
            ranked_by = "memory"
            ranking = rank(contenders, ranked_by, contract.baseline)
            status = "pending_target" if pending else "none"
        else:
            if by_memory:  # the baseline alone: staying needs no step time
                ranked_by = "memory"
            ranking = rank(contenders, ranked_by, contract.baseline)
            alone = [st.policy for st in ranking] == [contract.baseline]  # needs no figure
            if ranking and (alone or math.isfinite(ranking[0].score)):
                recommended = ranking[0].policy
                if ranked_by != "memory":
                    unsteady, promote = steadiness(
                        ranking, by_name, ranked_by, contract.baseline, gates.confidence
                    )
                    if not promote:
                        recommended = contract.baseline
                status = "stay" if recommended == contract.baseline else "recommended"
            else:
                what = {"memory": "memory", "speed": "step time"}
                speed_note = (
                    f"no {what.get(contract.objective, 'memory or step time')} measured for "
                    f"{', '.join(st.policy for st in ranking)} (a run of one step is not timed)"
                )
    for v in verdicts.values():
        for key, value in v.decide_with.items():
            if key in ("max_seeds", "steps"):  # the most any candidate needs
                decide_with[key] = max(value, decide_with.get(key, value))
            elif key == "step_caps":
                decide_with[key] = value
            # max_rel_loss_gap: a limit is the user's to choose, per candidate (its reason)
    open_ = [n for n, v in verdicts.items() if v.decide_with.get("max_seeds")]
    if "max_seeds" in decide_with and len(open_) < len(contract.candidates):
        # One look at a larger max_seeds for every candidate would rerun the settled
        # ones to it too: name the open ones, whose verdicts the rerun decides.
        decide_with["candidates"] = open_
    incomplete = _incomplete(records, contract)
    if incomplete and status in ("recommended", "stay"):
        recommended, status = None, "none"  # the missing runs could change the choice
    return Decision(
        baseline=contract.baseline,
        baseline_ok=not base_gate,
        baseline_reason=base_reason,
        verdicts=verdicts,
        recommended=recommended,
        too_short=too_short,
        max_seeds=contract.seed_limit,
        summaries=tuple(summaries),
        status=status,
        objective=contract.objective,
        ranking=ranking,
        ranked_by=ranked_by,
        pending=pending,
        speed_note=speed_note,
        baseline_note=baseline_note,
        hardware=hardware,
        target_device=contract.target_device,
        memory_budget=contract.memory_budget,
        max_slowdown=contract.max_slowdown,
        fp8_reference=fp8_reference,
        fp8_note=fp8_note,
        speed_pending=speed_pending,
        emulated=emulated,
        incomplete=incomplete,
        decide_with=decide_with,
        unsteady=unsteady,
        optimizer=contract.optimizer_label,
    )


def missing_runs(records: Sequence[RunRecord], contract: Contract) -> list[str]:
    """The runs of the contract's seeds (``"policy seed k"``) with no record, finished
    or failed: what an interrupted experiment has yet to train."""
    have = {(r.policy, r.seed) for r in records}
    return [
        f"{p} seed {k}"
        for k in range(contract.seeds)
        for p in contract.policies
        if (p, k) not in have
    ]


def _incomplete(records: Sequence[RunRecord], contract: Contract) -> str:
    """Why the decision cannot recommend yet (runs missing), or empty."""
    missing = missing_runs(records, contract)
    if not missing:
        return ""
    return (
        f"{len(missing)} run(s) of the contract's seeds have no record ({', '.join(missing)}): "
        "rerun compare to train them"
    )
