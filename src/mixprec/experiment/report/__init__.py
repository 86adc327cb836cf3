"""Reports of a precision experiment: results.json, report.md, report.html, a terminal table.

The report is one view model (`build_view`: every number and sentence, computed
once from the decision, the records and the contract) laid out by renderers that
only format it: Markdown, HTML and the terminal table. Plots are drawn with
matplotlib, imported only when a report is written.
"""

from mixprec.experiment.report.files import Report, render, results_dict
from mixprec.experiment.report.html import render_html
from mixprec.experiment.report.markdown import render_markdown
from mixprec.experiment.report.terminal import render_summary, render_table, terminal_table
from mixprec.experiment.report.view import (
    DecisionTable,
    FindingLine,
    PlotRef,
    PolicyRow,
    ReportView,
    build_view,
    decision_table,
)
from mixprec.experiment.report.wording import headline, verdict_label, verdict_reason

__all__ = [
    "DecisionTable",
    "FindingLine",
    "PlotRef",
    "PolicyRow",
    "Report",
    "ReportView",
    "build_view",
    "decision_table",
    "headline",
    "render",
    "render_html",
    "render_markdown",
    "render_summary",
    "render_table",
    "results_dict",
    "terminal_table",
    "verdict_label",
    "verdict_reason",
]
