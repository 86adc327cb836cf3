"""The terminal renderer: the decision as plain text, the table, every reason, the choice."""

from __future__ import annotations

import re
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

__all__ = ["PRINTED_COLUMNS", "WIDTH", "render_summary", "render_table", "terminal_table"]

#: The columns the printed table shows (`COLUMNS` names; the verdict as its label). The
#: absolute memory, skipped steps, frozen share and doctor rules are in report.md and
#: report.html; a gate they break is in the "why:" lines.
PRINTED_COLUMNS = (
    "policy",
    "steps",
    "seeds",
    "gap to baseline [interval]",
    "metric",
    "memory saved",
    "step time vs base",
    "verdict",
)
#: The printed table's width: columns wrap their cells (at spaces, keeping a bracketed
#: interval or range whole) until the table fits.
WIDTH = 100
_GAP = "  "
_GROUP = re.compile(r"[\[(][^\])]*[\])]")


def _plain(text: str) -> str:
    return text.replace("**", "").replace("`", "")


def _words(cell: str) -> list[str]:
    """The cell's words; a bracketed interval or parenthesized range is one word."""
    joined = _GROUP.sub(lambda m: m.group(0).replace(" ", "\0"), cell)
    return [w.replace("\0", " ") for w in joined.split()]


def _wrap(cell: str, width: int) -> list[str]:
    """`cell` in lines of at most `width` (a longer word stands alone)."""
    lines: list[str] = []
    for word in _words(cell):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def _widths(columns: list[list[str]], limit: int) -> list[int]:
    """Column widths within `limit` where the cells allow: the widest column gives up a
    character at a time, down to its longest word."""
    widths = [max(len(c) for c in col) for col in columns]
    floors = [max(len(w) for c in col for w in _words(c) or [""]) for col in columns]
    while sum(widths) + len(_GAP) * (len(widths) - 1) > limit:
        shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
    return [
        max(len(line) for c in col for line in _wrap(c, w))
        for col, w in zip(columns, widths, strict=True)
    ]


def render_table(table: DecisionTable, width: int = WIDTH) -> str:
    """`table` as aligned plain text within `width` columns where the cells allow
    (`PRINTED_COLUMNS`; the verdict cell shows the label, long cells wrap), then a
    "why:" line per row with a reason."""
    index = [COLUMNS.index(c) for c in PRINTED_COLUMNS]
    headers = [table.headers[i] for i in index]
    rows = [[(*r.cells[:-1], r.label)[i] for i in index] for r in table.rows]
    columns = [[h, *(r[i] for r in rows)] for i, h in enumerate(headers)]
    widths = _widths(columns, width)

    def block(cells: Sequence[str]) -> list[str]:
        wrapped = [_wrap(c, w) for c, w in zip(cells, widths, strict=True)]
        height = max(len(w) for w in wrapped)
        return [
            _GAP.join(
                (w[k] if k < len(w) else "").ljust(n) for w, n in zip(wrapped, widths, strict=True)
            ).rstrip()
            for k in range(height)
        ]

    lines = block(headers)
    lines.append(_GAP.join("-" * w for w in widths))
    for r in rows:
        lines += block(r)
    reasons = [f"  {r.policy}: {r.label}: {r.reason}" for r in table.rows if r.reason]
    if reasons:
        lines += ["", "why:", *reasons]
    return "\n".join(lines)


def terminal_table(
    decision: Decision, metric_name: str = "metric", records: Sequence[RunRecord] = ()
) -> str:
    """The printed decision table (`render_table`), then every reason."""
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
