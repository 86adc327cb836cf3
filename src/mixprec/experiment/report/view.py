"""The report's view model: everything a report shows, computed once.

`build_view` reads the decision, the run records and the contract and returns a
`ReportView` of finished strings (numbers already formatted, sentences already
written). The Markdown, HTML and terminal renderers only lay it out, so the
three say the same thing. Sentences may carry Markdown's inline markers (double
asterisks for strong text, backticks for code; see `mixprec.experiment.report.wording`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixprec.experiment.contract import Contract
from mixprec.experiment.decision import Decision
from mixprec.experiment.records import RunRecord
from mixprec.experiment.report.fp8 import FP8_HEADING, fp8_lines
from mixprec.experiment.report.fp8_plot import has_fp8_trace
from mixprec.experiment.report.wording import (
    choice_lines,
    gates_sentence,
    hardware_sentence,
    headline,
    loss_scale_moved,
    memory_saved_cell,
    objective_sentence,
    observations,
    step_time_cell,
    verdict_label,
    verdict_reason,
)
from mixprec.experiment.summary import PolicySummary, format_interval

__all__ = [
    "CHOICE_HEADING",
    "COLUMNS",
    "DECISION_HEADING",
    "DOCTOR_HEADING",
    "FP8_HEADING",
    "NO_FINDINGS",
    "OBSERVATIONS_HEADING",
    "PLOTS_HEADING",
    "TABLE_NOTE",
    "DecisionTable",
    "FindingLine",
    "PlotRef",
    "PolicyRow",
    "ReportView",
    "build_view",
    "decision_table",
    "setting_text",
]

#: The decision table's columns; ``metric`` is replaced by the workload's metric name.
COLUMNS = (
    "policy",
    "steps",
    "seeds",
    "gap to baseline [interval]",
    "metric",
    "skipped",
    "memory MiB",
    "memory saved",
    "step time vs base",
    "frozen",
    "doctor",
    "verdict",
)
#: The sentence under the decision table.
TABLE_NOTE = (
    "gap: mean over seeds of the relative held-out loss difference to the baseline on the "
    "same seed, with its t-interval in brackets; the baseline row gives its own seed spread. "
    "Memory is measured on one training step (parameters, gradients, master, moments, "
    "tensors saved for backward); memory saved and step time are relative to the baseline "
    "on the same seed (step time: the baseline's steps/s over the policy's), mean over seeds "
    "with their range in parentheses when it varies; the baseline's own speed is in the first "
    "line. frozen: share of parameter elements still at their initial value at the end."
)
DECISION_HEADING = "Decision"
CHOICE_HEADING = "The choice"
OBSERVATIONS_HEADING = "What the data show"
PLOTS_HEADING = "Plots"
DOCTOR_HEADING = "Doctor"
NO_FINDINGS = "No findings."

_MiB = 2.0**20
_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}
_PLOT_TITLES = {
    "cost_quality": "Cost against quality: memory and step time vs the paired loss gap",
    "loss": "Training loss",
    "heldout": "Held-out loss",
    "loss_scale": "Loss scale",
    "fp8": "FP8 casts: amax, scale, saturation and underflow",
    "memory": "Memory by component",
    "step_time": "Step time vs the baseline, paired per seed",
}


@dataclass(frozen=True, kw_only=True)
class PolicyRow:
    """One policy's row of the decision table, every cell formatted.

    Attributes:
        policy: the policy name.
        kind: ``base`` (the baseline), ``rec`` (the recommended candidate), or the
            verdict status (``eligible``, ``rejected``, ``inconclusive``, ``too_short``,
            ``not_run``).
        steps: steps trained, ``"12 of 60"`` for a capped run.
        seeds: how many seeds ran.
        gap: the paired gap to the baseline with its interval (the baseline: its
            own seed spread).
        metric: mean held-out metric.
        skipped: share of skipped steps.
        memory_mib: measured memory of one step in MiB.
        memory_saved: memory saved against the baseline (its range over seeds).
        step_time: step time relative to the baseline's on the same seed (its range
            over seeds): the table's one speed figure.
        frozen: share of parameter elements that never changed.
        doctor: doctor rule ids with their worst severity.
        label: the short verdict (``RECOMMENDED``, ``rejected (gate)``...).
        reason: the sentence behind the verdict ("" when there is none).
    """

    policy: str
    kind: str
    steps: str
    seeds: str
    gap: str
    metric: str
    skipped: str
    memory_mib: str
    memory_saved: str
    step_time: str
    frozen: str
    doctor: str
    label: str
    reason: str

    @property
    def verdict(self) -> str:
        """The label and its reason: ``rejected (gate): reason``."""
        return self.label + (f": {self.reason}" if self.reason else "")

    @property
    def cells(self) -> tuple[str, ...]:
        """The row's cells in `COLUMNS` order."""
        return (
            self.policy,
            self.steps,
            self.seeds,
            self.gap,
            self.metric,
            self.skipped,
            self.memory_mib,
            self.memory_saved,
            self.step_time,
            self.frozen,
            self.doctor,
            self.verdict,
        )


@dataclass(frozen=True, kw_only=True)
class DecisionTable:
    """The decision table: headers (the metric column named) and a row per policy."""

    headers: tuple[str, ...]
    rows: tuple[PolicyRow, ...]
    note: str = TABLE_NOTE


@dataclass(frozen=True, kw_only=True)
class FindingLine:
    """One distinct doctor finding as the report lists it, once for every policy it
    was found on.

    Attributes:
        rule: the rule id.
        severity: ``error``, ``warning`` or ``info``.
        where: where the rule looked.
        message: what it found.
        fix: what to do.
        policies: the policies it was found on (on any seed), in decision order.
        applies_to: `policies` as the report says them (``every policy`` when all).
    """

    rule: str
    severity: str
    where: str
    message: str
    fix: str
    policies: tuple[str, ...]
    applies_to: str


@dataclass(frozen=True, kw_only=True)
class PlotRef:
    """A plot of the report: its key (see `plots.PLOT_KEYS`), title and file under the
    report folder (``plots/<key>.png``)."""

    key: str
    title: str
    path: str


@dataclass(frozen=True, kw_only=True)
class ReportView:
    """Everything a report shows, as finished text.

    Attributes:
        title: the page title.
        hardware_line: where the runs were measured (CPU model and flags or GPU,
            torch, threads) and whether that is the target, one sentence.
        description: the workload, its ``--size`` and its description.
        headline: the recommendation, or why there is none.
        recommended: the recommended policy, or None.
        status: the decision's status (``recommended``, ``stay``, ``pending_target``,
            ``none``).
        settings_line: the run settings and seeds, one sentence.
        gates_line: the gates, one sentence.
        objective_line: the objective and the budgets, one sentence.
        table: the decision table.
        choice: how the recommendation was made: the rule, each contender's figures
            (the balanced arithmetic written out), the outcome; empty when no
            policy was in the running.
        observations: notes, then what the data show, one statement each.
        fp8: the FP8 section (empty without FP8 candidates): each candidate's gap to
            its 16-bit reference and to the baseline, by how much a failing one
            fails, its worst tensors from the FP8 traces, the doctor's fp8 findings.
        plots: the plots, in report order.
        doctor: the distinct doctor findings, each naming the policies it was found on,
            the most severe first.
    """

    title: str
    hardware_line: str
    description: str
    headline: str
    recommended: str | None
    status: str
    settings_line: str
    gates_line: str
    objective_line: str
    table: DecisionTable
    choice: tuple[str, ...]
    observations: tuple[str, ...]
    plots: tuple[PlotRef, ...]
    fp8: tuple[str, ...] = ()
    doctor: tuple[FindingLine, ...]


def _fmt(v: float, spec: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


def _doctor_cell(policy: str, records: Sequence[RunRecord]) -> str:
    """Rule ids with their worst severity, most severe first."""
    worst: dict[str, str] = {}
    for r in records:
        if r.policy != policy:
            continue
        for f in r.doctor:
            rule, sev = str(f.get("rule", "")), str(f.get("severity", "info"))
            if rule and _SEVERITY_RANK.get(sev, 3) < _SEVERITY_RANK.get(worst.get(rule, ""), 3):
                worst[rule] = sev
    ordered = sorted(worst.items(), key=lambda kv: (_SEVERITY_RANK.get(kv[1], 3), kv[0]))
    return ", ".join(f"{rule} ({sev})" for rule, sev in ordered) or "-"


def _gap_cell(s: PolicySummary, decision: Decision) -> str:
    if s.policy == decision.baseline:
        spread = s.baseline_spread
        return f"seed spread {spread:.2%} (sd)" if math.isfinite(spread) else "-"
    return format_interval(s.gap)


def _kind(policy: str, decision: Decision) -> str:
    if policy == decision.baseline:
        return "base"
    if policy == decision.recommended:
        return "rec"
    v = decision.verdicts.get(policy)
    return v.status if v is not None else ""


def decision_table(
    decision: Decision, records: Sequence[RunRecord] = (), metric_name: str = "metric"
) -> DecisionTable:
    """The decision table of `decision`: a formatted row per policy, in decision order."""
    full = max((s.steps for s in decision.summaries), default=0)
    rows = tuple(
        PolicyRow(
            policy=s.policy,
            kind=_kind(s.policy, decision),
            steps=str(s.steps) if s.steps == full else f"{s.steps} of {full}",
            seeds=str(len(s.heldout_losses)),
            gap=_gap_cell(s, decision),
            metric=_fmt(s.metric, ".4f"),
            skipped=f"{s.skipped_fraction:.1%}",
            memory_mib=_fmt(s.total_bytes / _MiB, ".2f"),
            memory_saved=memory_saved_cell(s.memory_ratio, s.policy == decision.baseline),
            step_time=step_time_cell(s.time_ratio, s.policy == decision.baseline)
            + (" emulated" if s.policy in decision.emulated else ""),
            frozen=_fmt(s.frozen_fraction * 100, ".1f") + "%",
            doctor=_doctor_cell(s.policy, records),
            label=verdict_label(s.policy, decision),
            reason=verdict_reason(s.policy, decision),
        )
        for s in decision.summaries
    )
    headers = tuple(metric_name if h == "metric" else h for h in COLUMNS)
    return DecisionTable(headers=headers, rows=rows)


def _doctor_findings(records: Sequence[RunRecord], order: Sequence[str]) -> tuple[FindingLine, ...]:
    """Each distinct finding (same rule, severity, place, message and fix) once, with the
    policies it was found on in `order`; the most severe first, then as found. A policy's
    rule at one place is taken from its first seed that found it (later seeds repeat it
    with their own figures)."""
    rank = {name: i for i, name in enumerate(order)}
    found: dict[tuple[str, str, str, str, str], list[str]] = {}
    taken: set[tuple[str, str, str]] = set()
    for r in sorted(records, key=lambda r: (rank.get(r.policy, len(rank)), r.seed)):
        for f in r.doctor:
            place = (r.policy, str(f.get("rule", "")), str(f.get("where", "")))
            if place in taken:
                continue
            taken.add(place)
            key = (
                str(f.get("rule", "")),
                str(f.get("severity", "info")),
                str(f.get("where", "")),
                str(f.get("message", "")),
                str(f.get("fix", "")),
            )
            seen = found.setdefault(key, [])
            if r.policy not in seen:
                seen.append(r.policy)
    ran = {r.policy for r in records}
    lines = []
    for key in sorted(found, key=lambda k: _SEVERITY_RANK.get(k[1], 3)):
        rule, severity, where, message, fix = key
        policies = tuple(found[key])
        every = len(ran) > 1 and set(policies) == ran
        lines.append(
            FindingLine(
                rule=rule,
                severity=severity,
                where=where,
                message=message,
                fix=fix,
                policies=policies,
                applies_to="every policy" if every else ", ".join(policies),
            )
        )
    return tuple(lines)


def _plots(records: Sequence[RunRecord], decision: Decision) -> tuple[PlotRef, ...]:
    """The plots this report holds: cost against quality when a candidate has a paired
    gap, the loss-scale trace only when a policy's scale moved, the FP8 panel only when
    a run stored an FP8 trace."""
    keys = []
    if any(math.isfinite(s.gap.mean) for s in decision.summaries[1:]):
        keys.append("cost_quality")
    keys += ["loss", "heldout"]
    if any(loss_scale_moved(records).values()):
        keys.append("loss_scale")
    if has_fp8_trace(records):
        keys.append("fp8")
    keys += ["memory", "step_time"]
    return tuple(PlotRef(key=k, title=_PLOT_TITLES[k], path=f"plots/{k}.png") for k in keys)


def setting_text(value: Any) -> str:
    """A setting as the settings line writes it: floats shortest-readable (``0.0003``,
    ``1e-5``, 6 significant digits), lists and tuples item by item."""
    if isinstance(value, float) and math.isfinite(value):
        mantissa, _, exponent = f"{value:.6g}".partition("e")
        return mantissa + (f"e{int(exponent)}" if exponent else "")
    if isinstance(value, list | tuple):
        inner = ", ".join(setting_text(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return str(value)


def build_view(
    contract: Contract,
    records: Sequence[RunRecord],
    decision: Decision,
    *,
    workload_description: str = "",
    metric_name: str = "metric",
    settings: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> ReportView:
    """Everything the report shows, from the decision, the records and the contract.

    Args:
        contract: the contract that ran.
        records: its run records.
        decision: the decision over them.
        workload_description: one line about the workload.
        metric_name: the workload's held-out metric.
        settings: the run settings, listed in the settings line.
        notes: statements listed first under "What the data show" (records skipped
            or missing, say).
    """
    shown = dict(settings or {})
    # Folders written before settings named the optimizer: the contract does.
    shown.setdefault("optimizer", contract.optimizer_label)
    setting_line = ", ".join(f"{k} {setting_text(v)}" for k, v in shown.items())
    # A module:function takes --size only when it was given one (its records say
    # "default" otherwise, which it may not accept).
    recorded = next((r.size for r in records if r.size), "")
    size = contract.size or ("" if ":" in contract.workload else recorded)
    workload = f"`{contract.workload}" + (f" --size {size}`" if size else "`")
    return ReportView(
        title=f"mixprec compare: {contract.workload}",
        hardware_line=hardware_sentence(decision),
        description=f"Workload {workload}"
        + (f": {workload_description}" if workload_description else "."),
        headline=headline(decision),
        recommended=decision.recommended,
        status=decision.status,
        settings_line=(
            f"Settings: {setting_line}; seeds {contract.seeds} (up to {contract.seed_limit})."
        ),
        gates_line=f"Gates: {gates_sentence(contract, metric_name)}.",
        objective_line=objective_sentence(decision),
        table=decision_table(decision, records, metric_name),
        choice=choice_lines(decision),
        observations=(*notes, *observations(records, decision)),
        plots=_plots(records, decision),
        fp8=fp8_lines(
            records,
            decision,
            limit=contract.gates.max_rel_loss_gap,
            confidence=contract.gates.confidence,
        ),
        doctor=_doctor_findings(records, [s.policy for s in decision.summaries]),
    )
