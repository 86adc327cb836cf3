"""The report's files: results.json, report.md, report.html and the plots, from real runs."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import pytest

import mixprec
from mixprec.experiment import Contract, decide, render
from mixprec.experiment.report import (
    build_view,
    decision_table,
    render_html,
    render_markdown,
    render_table,
    terminal_table,
    verdict_reason,
)

from .judged import STEPS, Judged

pytestmark = pytest.mark.plots  # draws the plots for real (see tests/conftest.py)


def test_report_renders_without_display(
    every_preset: tuple[Path, Contract, list], tmp_path: Path
) -> None:  # type: ignore[type-arg]
    _out, contract, records = every_preset
    decision = decide(records, contract, higher_is_better=True)
    report = render(tmp_path, contract, records, decision, metric_name="macro_f1")
    page = report.html.read_text()
    assert page.count("data:image/png;base64,") == len(report.plots) >= 4
    assert "Decision" in page and "fp16_unscaled" in page
    md = report.markdown.read_text()
    assert "| policy |" in md and "plots/loss.png" in md
    results = json.loads(report.results_json.read_text())
    assert {"workload", "baseline", "runs", "decision"} <= set(results)
    assert set(results["decision"]) >= {"eligible", "rejected", "recommended"}
    assert all(isinstance(run["doctor"], list) for run in results["runs"])


def test_every_reason_is_printed_and_rendered(tmp_path: Path) -> None:
    results = mixprec.compare(
        "digits",
        "amp_bf16,bf16_pure,fp16_unscaled",
        seeds=2,
        max_seeds=2,
        steps=40,
        size="tiny",
        out=tmp_path,
        progress=False,
    )
    d = results.decision
    table = terminal_table(d, "macro_f1", results.records)
    md = results.report.markdown.read_text()
    page = results.report.html.read_text()
    for name in d.verdicts:
        reason = verdict_reason(name, d)
        assert reason
        assert reason in table and reason in md.replace("\\|", "|")
        assert html.escape(reason) in page
    base = d.summary("fp32")
    wide = render_table(decision_table(d, results.records, "macro_f1"), width=400)
    assert f"seed spread {base.baseline_spread:.2%}" in wide
    stored = json.loads(results.report.results_json.read_text())["decision"]["policies"]
    for name in d.verdicts:
        assert {"gaps", "gap_low", "gap_high", "baseline_spread", "seeds", "verdict"} <= set(
            stored[name]
        )


def test_report_files_are_the_view_rendered(judged: Judged, tmp_path: Path) -> None:
    """render() writes what the renderers make of one view, and the same again on a rerun."""
    kw: dict[str, Any] = dict(
        workload_description="8x8 digits",
        metric_name="macro_f1",
        settings={"steps": STEPS},
        notes=("a note",),
    )
    report = render(tmp_path, judged.contract, judged.records, judged.decision, **kw)
    view = build_view(judged.contract, judged.records, judged.decision, **kw)
    assert report.plots == tuple(tmp_path / p.path for p in view.plots)
    images = {p.key: (tmp_path / p.path).read_bytes() for p in view.plots}
    assert report.markdown.read_text(encoding="utf-8") == render_markdown(view)
    assert report.html.read_text(encoding="utf-8") == render_html(view, images)
    stored = json.loads(report.results_json.read_text())
    assert stored["notes"] == ["a note"] and stored["settings"] == {"steps": STEPS}
    first = report.html.read_bytes()
    render(tmp_path, judged.contract, judged.records, judged.decision, **kw)
    assert report.html.read_bytes() == first
