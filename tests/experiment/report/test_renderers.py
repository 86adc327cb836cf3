"""The renderers only lay out one view model: report.md, report.html and the terminal
table carry the same numbers, intervals and reasons, and none of their own."""

from __future__ import annotations

import dataclasses
import html
import re

from mixprec.experiment.report import (
    ReportView,
    build_view,
    render_html,
    render_markdown,
    render_table,
)
from mixprec.experiment.report.terminal import PRINTED_COLUMNS
from mixprec.experiment.report.view import COLUMNS

from .judged import STEPS, Judged

NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?%?")
PERCENT = re.compile(r"[+-]?\d+(?:\.\d+)?%")
INTERVAL = re.compile(r"\[[+-]?\d+(?:\.\d+)?%, [+-]?\d+(?:\.\d+)?%\]")
#: Stand-in PNG bytes: the renderers embed what they are given.
IMAGES = {
    k: b"\x89PNG" + k.encode()
    for k in ("cost_quality", "loss", "heldout", "loss_scale", "memory", "step_time")
}


def _view(judged: Judged) -> ReportView:
    return build_view(
        judged.contract,
        judged.records,
        judged.decision,
        workload_description="8x8 digits, 10 classes",
        metric_name="macro_f1",
        settings={"steps": STEPS, "lr": 0.003, "batch_size": 64},
        notes=("ignored 2 record(s) of other policies or settings",),
    )


def _unmark(text: str) -> str:
    return text.replace("**", "").replace("`", "")


def _md_text(md: str) -> str:
    """report.md as plain text: table escapes undone, inline markers dropped."""
    return _unmark(md.replace("\\|", "|"))


def _html_text(page: str) -> str:
    """report.html's body as plain text: tags (and the embedded images) dropped."""
    body = page.split("<body>", 1)[1]
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def _view_text(view: ReportView) -> str:
    """Every string of the view, in report order."""
    parts = [view.title, view.hardware_line, view.headline, view.description]
    parts += [view.settings_line, view.gates_line, view.objective_line]
    parts += view.table.headers
    parts += [c for r in view.table.rows for c in r.cells]
    parts += [view.table.note, *view.choice, *view.observations]
    parts += [t for p in view.plots for t in (p.title, p.path)]
    for f in view.doctor:
        parts += [f.rule, f.severity, f.where, f.applies_to, f.message, f.fix]
    return _unmark("\n".join(parts))


def test_markdown_and_html_carry_the_same_numbers_in_the_same_order(judged: Judged) -> None:
    view = _view(judged)
    md = _md_text(render_markdown(view))
    page = _html_text(render_html(view, IMAGES))
    numbers = NUMBER.findall(md)
    assert len(numbers) > 100
    assert numbers == NUMBER.findall(page)
    assert PERCENT.findall(md) == PERCENT.findall(page)
    intervals = INTERVAL.findall(md)
    assert intervals == INTERVAL.findall(page)
    # Every gap interval of the table, in the table and again in what the data show.
    gaps = [r.gap.split(" ", 1)[1] for r in view.table.rows[1:]]
    assert all(intervals.count(g) >= 2 for g in gaps), (gaps, intervals)


def test_the_renderers_add_no_number_of_their_own(judged: Judged) -> None:
    view = _view(judged)
    expected = sorted(NUMBER.findall(_view_text(view)))
    assert sorted(NUMBER.findall(_md_text(render_markdown(view)))) == expected
    assert sorted(NUMBER.findall(_html_text(render_html(view, IMAGES)))) == expected


def test_every_reason_sentence_and_cell_is_in_both(judged: Judged) -> None:
    view = _view(judged)
    md = _md_text(render_markdown(view))
    page = _html_text(render_html(view, IMAGES))
    table = render_table(view.table)
    for row in view.table.rows:
        for cell in row.cells:
            assert cell in md and cell in page, cell
        if row.reason:
            assert f"{row.policy}: {row.label}: {row.reason}" in table
    sentences = (view.hardware_line, view.headline, view.description, view.settings_line)
    sentences += (view.gates_line, view.objective_line, view.table.note, *view.choice)
    for sentence in sentences:
        assert _unmark(sentence) in md and _unmark(sentence) in page, sentence
    for o in view.observations:
        assert _unmark(o) in md and _unmark(o) in page, o
    for f in view.doctor:
        line = f"{f.rule} ({f.severity}, {f.where}; {f.applies_to}): {f.message}"
        assert line in md and line in " ".join(page.split()), line


def test_the_terminal_table_shows_the_same_cells(judged: Judged) -> None:
    """The printed columns' cells, as the view has them (wide enough not to wrap)."""
    view = _view(judged)
    table = render_table(view.table, width=400)
    assert (
        table.splitlines()[0].split()
        == " ".join(view.table.headers[COLUMNS.index(c)] for c in PRINTED_COLUMNS).split()
    )
    for row in view.table.rows:
        line = next(li for li in table.splitlines() if li.startswith(row.policy + " "))
        for name in PRINTED_COLUMNS[:-1]:
            assert row.cells[COLUMNS.index(name)] in line, (name, line)
        assert line.endswith(row.label)


def test_markup_is_the_only_difference(judged: Judged) -> None:
    """Characters each format reserves are escaped; the text stays the same."""
    view = _view(judged)
    md = render_markdown(view)
    page = render_html(view, IMAGES)
    assert "41.5% of updates \\| rounded away (< half a bf16 ulp)" in md  # in the table
    assert "41.5% of updates | rounded away (< half a bf16 ulp) Fix:" in md  # in the doctor list
    assert "41.5% of updates | rounded away (&lt; half a bf16 ulp)" in page
    assert "keep an fp32 master &amp; retry" in page
    assert "Recommended: **bf16_master**" in md and "Recommended: bf16_master" in page
    assert "`amp_fp16` ran 10 of 50 steps" in md and "<li>amp_fp16 ran 10 of 50 steps" in page
    assert "class='verdict'" in page
    for row in view.table.rows:
        assert f"<tr class='{row.kind}'><td>{row.policy}</td>" in page


def test_renderers_format_a_view_built_by_hand(judged: Judged) -> None:
    """No decision needed: whatever the view says is what the files say."""
    view = dataclasses.replace(
        _view(judged),
        title="a <title> | with markup",
        headline="No candidate passed the gates.",
        recommended=None,
        observations=(),
        plots=(),
        doctor=(),
    )
    md = render_markdown(view)
    page = render_html(view, {})
    assert md.startswith("# a <title> | with markup\n")
    assert "<h1>a &lt;title&gt; | with markup</h1>" in page
    assert "class='verdict fail'>No candidate passed the gates.</div>" in page
    assert "What the data show" not in md and "What the data show" not in page
    assert "## Doctor\n\nNo findings." in md and "<p>No findings.</p>" in page
    assert "data:image/png" not in page and "![" not in md


def test_html_embeds_each_plot_by_key(judged: Judged) -> None:
    view = _view(judged)
    page = render_html(view, IMAGES)
    md = render_markdown(view)
    for p in view.plots:
        assert f"![{p.title}]({p.path})" in md
        assert f"alt='{p.title}'" in page
    assert page.count("data:image/png;base64,") == len(view.plots) == 6
