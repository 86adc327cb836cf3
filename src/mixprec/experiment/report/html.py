"""The HTML renderer: lays out a `ReportView` as a self-contained report.html (plots embedded)."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping

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

__all__ = ["render_html"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;
max-width:1100px;
color:#222;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}
h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;width:100%}
th,td{border:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4}tr.rec td{background:#e8f6e8;font-weight:600}
tr.rejected td{color:#777}tr.inconclusive td,tr.too_short td{background:#fdf6e3}
tr.base td{background:#f4f7fc}.verdict{font-size:1.15em;margin:.6em 0;padding:.5em .8em;
background:#eef6ee;border-left:4px solid #3a3}.fail{background:#fbeeee;border-left-color:#c33}
.muted{color:#666;font-size:.9em}img{max-width:100%;border:1px solid #eee;margin:.4em 0}
.sev-error{color:#b00;font-weight:600}.sev-warning{color:#a60}.sev-info{color:#357}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:.8em}
.hw{font-size:.9em;margin:.2em 0}.pending{background:#fdf6e3;border-left-color:#c90}
"""


def _e(text: str) -> str:
    return html.escape(text)


def _inline(text: str) -> str:
    """Escaped text without the Markdown ``**`` and backtick markers."""
    return _e(text).replace("**", "").replace("`", "")


def render_html(view: ReportView, images: Mapping[str, bytes]) -> str:
    """The report as one HTML page.

    Args:
        view: the report.
        images: PNG bytes by plot key (`PlotRef.key`), embedded as data URIs.
    """
    cls = {"pending_target": "verdict pending"}.get(
        view.status, "verdict" if view.recommended else "verdict fail"
    )
    table = view.table
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{_e(view.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(view.title)}</h1><p class='hw'>{_inline(view.hardware_line)}</p>",
        f"<div class='{cls}'>{_inline(view.headline)}</div>",
        f"<p class='muted'>{_inline(view.description)}<br>{_e(view.settings_line)}<br>"
        f"{_e(view.gates_line)}<br>{_e(view.objective_line)}</p>",
        f"<h2>{DECISION_HEADING}</h2><table><tr>"
        + "".join(f"<th>{_e(h)}</th>" for h in table.headers)
        + "</tr>",
    ]
    for row in table.rows:
        cells = "".join(f"<td>{_e(c)}</td>" for c in row.cells)
        out.append(f"<tr class='{row.kind}'>{cells}</tr>")
    out.append(f"</table><p class='muted'>{_e(table.note)}</p>")
    if view.choice:
        out.append(f"<h3>{CHOICE_HEADING}</h3><p>{_inline(view.choice[0])}</p><ul>")
        out += [f"<li>{_inline(line)}</li>" for line in view.choice[1:]]
        out.append("</ul>")
    if view.observations:
        out.append(f"<h2>{OBSERVATIONS_HEADING}</h2><ul>")
        out += [f"<li>{_inline(o)}</li>" for o in view.observations]
        out.append("</ul>")
    if view.fp8:
        out.append(f"<h2>{FP8_HEADING}</h2><ul>")
        out += [f"<li>{_inline(line)}</li>" for line in view.fp8]
        out.append("</ul>")
    out.append(f"<h2>{PLOTS_HEADING}</h2>")
    for plot in view.plots:
        b64 = base64.b64encode(images[plot.key]).decode("ascii")
        out.append(
            f"<figure><img alt='{_e(plot.title)}' src='data:image/png;base64,{b64}'></figure>"
        )
    out.append(f"<h2>{DOCTOR_HEADING}</h2>")
    if not view.doctor:
        out.append(f"<p>{NO_FINDINGS}</p>")
    if view.doctor:
        out.append("<ul>")
    for f in view.doctor:
        out.append(
            f"<li><span class='sev-{_e(f.severity)}'>{_e(f.rule)}</span> ({_e(f.severity)}, "
            f"{_e(f.where)}; {_e(f.applies_to)}): {_e(f.message)}<br><i>Fix:</i> {_e(f.fix)}</li>"
        )
    if view.doctor:
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out)
