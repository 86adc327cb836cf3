"""The Markdown renderer: lays out a `ReportView` as report.md (plots linked as PNG files)."""

from __future__ import annotations

from collections.abc import Sequence

from mixprec.experiment.report.view import (
    CHOICE_HEADING,
    DECISION_HEADING,
    DOCTOR_HEADING,
    FP8_HEADING,
    NO_FINDINGS,
    OBSERVATIONS_HEADING,
    PLOTS_HEADING,
    ReportView,
)

__all__ = ["render_markdown"]


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(view: ReportView) -> str:
    """The report as Markdown; plots are linked by their relative paths."""
    md = [f"# {view.title}", "", view.hardware_line, "", view.headline, ""]
    md += [view.description, "", view.settings_line, "", view.gates_line, ""]
    md += [view.objective_line, ""]
    md += [f"## {DECISION_HEADING}", ""]
    md += [_table(view.table.headers, [r.cells for r in view.table.rows]), ""]
    md += [view.table.note, ""]
    if view.choice:
        md += [f"### {CHOICE_HEADING}", "", view.choice[0], ""]
        md += [f"- {line}" for line in view.choice[1:]] + [""]
    if view.observations:
        md += [f"## {OBSERVATIONS_HEADING}", ""] + [f"- {o}" for o in view.observations] + [""]
    if view.fp8:
        md += [f"## {FP8_HEADING}", ""] + [f"- {line}" for line in view.fp8] + [""]
    md += [f"## {PLOTS_HEADING}", ""]
    md += [f"![{p.title}]({p.path})" for p in view.plots] + [""]
    md += [f"## {DOCTOR_HEADING}", ""]
    if not view.doctor:
        md += [NO_FINDINGS, ""]
    md += [
        f"- **{f.rule}** ({f.severity}, {f.where}; {f.applies_to}): {f.message} Fix: {f.fix}"
        for f in view.doctor
    ]
    if view.doctor:
        md.append("")
    return "\n".join(md)
