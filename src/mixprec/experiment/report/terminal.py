"""The terminal renderer: the decision as plain text, the table, every reason, the choice."""

from __future__ import annotations

from collections.abc import Sequence

from mixprec.experiment.decision import Decision
from mixprec.experiment.records import RunRecord
from mixprec.experiment.report.view import (
    CHOICE_HEADING,
    COLUMNS,
    FP8_HEADING,
    DecisionTable,
    ReportView,
    decision_table,
)

__all__ = ["render_summary", "render_table", "terminal_table"]


def _plain(text: str) -> str:
    return text.replace("**", "").replace("`", "")


def render_table(table: DecisionTable) -> str:
    """`table` as aligned plain text without the doctor column (the verdict cell shows
    the label), then a "why:" line per row with a reason."""
    doctor = COLUMNS.index("doctor")
    headers = table.headers[:doctor] + table.headers[doctor + 1 :]
    rows = [(*r.cells[:doctor], r.label) for r in table.rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    reasons = [f"  {r.policy}: {r.label}: {r.reason}" for r in table.rows if r.reason]
    if reasons:
        lines += ["", "why:", *reasons]
    return "\n".join(lines)


def terminal_table(
    decision: Decision, metric_name: str = "metric", records: Sequence[RunRecord] = ()
) -> str:
    """A plain-text decision table (without the doctor column), then every reason."""
    return render_table(decision_table(decision, records, metric_name))


def render_summary(view: ReportView) -> str:
    """What `mixprec compare` and `mixprec report` print: the hardware and the headline
    (the recommendation, or why there is none, pending a target included) first, in
    the report's order, then the objective, the table with every reason, the choice, and
    the FP8 section when FP8 candidates ran."""
    lines = [_plain(view.hardware_line), _plain(view.headline), _plain(view.objective_line), ""]
    lines.append(render_table(view.table))
    if view.choice:
        lines += ["", f"{CHOICE_HEADING.lower()}: {_plain(view.choice[0])}"]
        lines += [f"  {_plain(line)}" for line in view.choice[1:]]
    if view.fp8:
        lines += ["", f"{FP8_HEADING.lower()}: {_plain(view.fp8[0])}"]
        lines += [f"  {_plain(line)}" for line in view.fp8[1:]]
    return "\n".join(lines)
