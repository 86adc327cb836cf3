"""The report's FP8 panel and section: drawn and written when FP8 candidates ran, absent
otherwise, emulated step times marked, and re-rendered by `mixprec report` from records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import mixprec
from mixprec.cli import main
from mixprec.experiment import decide
from mixprec.experiment.fp8_trace import build_fp8_trace
from mixprec.experiment.report import (
    build_view,
    plots,
    render_html,
    render_markdown,
    render_summary,
)
from mixprec.experiment.report.fp8_plot import plot_fp8
from mixprec.experiment.stats import paired_interval
from mixprec.experiment.summary import format_interval

from ..test_fp8_trace import sample, stats
from .judged import Judged
from .judged_fp8 import BASE, GAPS, WORST, make_judged_fp8

pytestmark = pytest.mark.plots  # draws the plots for real (see tests/conftest.py)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fp8_judged() -> Judged:
    return make_judged_fp8()


def _view(j: Judged) -> mixprec.experiment.report.ReportView:
    return build_view(j.contract, j.records, j.decision, metric_name="bits_per_char")


def _gap_to_bf16(policy: str) -> str:
    """The paired gap of `policy` to amp_bf16, computed from the constructed losses."""
    gaps = []
    for b, g, r in zip(BASE, GAPS[policy], GAPS["amp_bf16"], strict=True):
        gaps.append((b * (1 + g) - b * (1 + r)) / (b * (1 + r)))
    return format_interval(paired_interval(gaps, 0.90))


def test_the_section_gives_each_gap_to_the_reference_and_how_far_a_failure_is(
    fp8_judged: Judged,
) -> None:
    d = fp8_judged.decision
    assert d.fp8_reference == "amp_bf16"
    assert d.verdicts["fp8_rowwise"].gate == "fp8-reference"
    lines = _view(fp8_judged).fp8
    assert "judged against `fp32` and the 16-bit `amp_bf16`" in lines[0]
    fp8 = [name for name in GAPS if name.startswith("fp8")]
    by = {name: next(ln for ln in lines if ln.startswith(f"`{name}`: gap")) for name in fp8}
    for name in ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp"):
        assert f"gap to `amp_bf16` {_gap_to_bf16(name)} (90% t-interval, 3 seeds" in by[name]
    assert "**eligible, speed pending a run on FP8 hardware" in by["fp8_tensorwise"]
    rejected = by["fp8_rowwise"]
    gap = paired_interval(
        [(1 + g) / (1 + r) - 1 for g, r in zip(GAPS["fp8_rowwise"], GAPS["amp_bf16"], strict=True)],
        0.90,
    )
    assert "**rejected (fp8-reference)**" in rejected
    assert f"fails by {100 * (gap.low - 0.005):.2f} points" in rejected
    assert f"low end {gap.low:+.2%} is over the 0.50% limit" in rejected


def test_the_section_names_the_worst_tensors_and_the_doctors_findings(
    fp8_judged: Judged,
) -> None:
    lines = _view(fp8_judged).fp8
    worst = next(ln for ln in lines if ln.startswith("`fp8_tensorwise` worst fp8 tensors"))
    assert "(12 fp8 layers, 3 sampled steps, 3 seed(s))" in worst
    # the flushing gradient first (3.000% on seed 1; mean over 9 samples: (8 x 1% + 3%) / 9)
    first = worst.split(": ", 1)[1].split("; ")[0]
    assert first.startswith(f"{WORST}, fp8_e5m2: underflow up to 3.000% (mean 1.222%)")
    assert "delayed-scaling what-if would clip up to 25.00%" in worst
    finding = next(ln for ln in lines if ln.startswith("doctor `fp8-underflow`"))
    assert finding == (
        f"doctor `fp8-underflow` (warning, measured) on `fp8_tensorwise` seed 1: {WORST}, "
        "3.00% at step 20 (threshold 1.00%), steps 20-40 (2 samples over the threshold)"
    )
    assert any(ln.startswith("`fp8_rowwise_gw_hp`: no FP8 trace stored") for ln in lines)
    assert any("ran emulated" in ln for ln in lines)


def test_renderers_lay_out_the_section_and_the_panel(fp8_judged: Judged) -> None:
    view = _view(fp8_judged)
    assert [p.key for p in view.plots] == [
        "cost_quality", "loss", "heldout", "fp8", "memory", "step_time"
    ]  # fmt: skip
    md = render_markdown(view)
    assert "## FP8" in md and "![FP8 casts" in md and "(plots/fp8.png)" in md
    assert md.index("## FP8") < md.index("## Plots")
    images = plots.draw(
        [p.key for p in view.plots], fp8_judged.records, fp8_judged.decision, gap_limit=0.005
    )
    assert images["fp8"].startswith(PNG)
    page = render_html(view, images)
    assert "<h2>FP8</h2>" in page and "fails by" in page and "**" not in page
    text = render_summary(view)
    assert "\nfp8: FP8 candidates are judged against fp32" in text and "`" not in text


def test_without_fp8_candidates_there_is_no_section_nor_panel(judged: Judged) -> None:
    view = build_view(judged.contract, judged.records, judged.decision)
    assert view.fp8 == () and "fp8" not in [p.key for p in view.plots]
    assert "## FP8" not in render_markdown(view)
    with pytest.raises(ValueError, match=r"plot 'fp8' has nothing to draw \(no run stored an"):
        plots.draw(["fp8"], judged.records, judged.decision, gap_limit=0.005)


def test_the_panels_legends_cover_no_data(fp8_judged: Judged) -> None:
    plt = plots._pyplot()
    colors = {r.policy: plots.policy_color(r.policy) for r in fp8_judged.records}
    fig = plot_fp8(fp8_judged.records, fp8_judged.decision, colors, plt)
    assert fig is not None
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = fig.legends
    assert len(legends) == 2
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), legend.get_title().get_text()
    titles = [t.get_text() for t in legends[0].get_texts()]
    # two traced policies, their 3 worst tensors each (the untraced one draws nothing)
    assert len(titles) == 6 and titles[0] == f"fp8_tensorwise: {WORST}"
    assert [t.get_text() for t in legends[1].get_texts()] == [
        "fp8_tensorwise",
        "fp8_rowwise",
        "measured",
        "delayed what-if",
    ]
    plt.close(fig)


def test_a_memory_tie_broken_on_emulated_step_times_is_said() -> None:
    j = make_judged_fp8("memory")
    d = j.decision
    assert d.speed_pending == () and d.recommended == "fp8_tensorwise"
    view = _view(j)
    assert any("measured under FP8 emulation" in line for line in view.choice)
    row = next(r for r in view.table.rows if r.policy == "fp8_tensorwise")
    assert row.step_time == "2.50x emulated" and row.label == "RECOMMENDED"


def test_the_balanced_choice_leaves_emulated_fp8_out(fp8_judged: Judged) -> None:
    view = _view(fp8_judged)
    assert view.recommended == "amp_bf16"
    assert "Eligible on quality, speed pending a run on FP8 hardware" in view.headline
    assert any(
        line.startswith("Left out of this ranking: `fp8_tensorwise`") for line in view.choice
    )
    row = next(r for r in view.table.rows if r.policy == "fp8_rowwise_gw_hp")
    assert row.label == "eligible, speed pending FP8 hardware"


def test_mixprec_report_rerenders_the_fp8_panel_from_stored_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchao.float8")
    results = mixprec.compare(
        "shakespeare",
        "amp_bf16,fp8_tensorwise",
        seeds=2,
        max_seeds=2,
        steps=6,
        size="tiny",
        eval_every=3,
        probe_every=2,
        out=tmp_path,
        progress=False,
    )
    first = results.report.markdown.read_text()
    assert "## FP8" in first and (tmp_path / "plots" / "fp8.png").is_file()
    for path in (results.report.markdown, results.report.html, tmp_path / "plots" / "fp8.png"):
        path.unlink()
    code = main(["report", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code in (0, 1)
    again = (tmp_path / "report.md").read_text()
    assert again == first
    assert (tmp_path / "plots" / "fp8.png").read_bytes().startswith(PNG)
    assert "fp8: FP8 candidates" in printed and "fp8_tensorwise worst fp8 tensors" in printed
    stored = json.loads((tmp_path / "runs" / "fp8_tensorwise-seed0.json").read_text())
    assert stored["fp8_trace"]["samples"] == 3


# ------------------------------------------------ an FP8 policy that converted no layer

UNCONVERTED = {
    "fp8": {
        "recipe": "tensorwise",
        "emulate": True,
        "converted": [],
        "kept": [
            {"name": "0", "reason": "first nn.Linear (skip_first_last)"},
            {"name": "2", "reason": "last nn.Linear (skip_first_last)"},
        ],
    }
}


def test_an_fp8_policy_that_converted_no_layer_is_said_to_train_in_16_bits() -> None:
    j = make_judged_fp8("balanced", effective=UNCONVERTED)
    d = j.decision
    assert d.emulated == () and d.speed_pending == ()  # its step times are 16-bit ones
    view = _view(j)
    row = next(r for r in view.table.rows if r.policy == "fp8_tensorwise")
    assert "emulated" not in row.step_time and "speed pending" not in row.label
    text = "\n".join(view.fp8)
    assert "ran emulated" not in text and "rerun into a fresh --out" not in text
    line = next(ln for ln in view.fp8 if ln.startswith("`fp8_tensorwise` converted no layer"))
    assert "trained entirely in 16 bits" in line
    assert "kept 0: first nn.Linear (skip_first_last); 2: last nn.Linear" in line
    assert "relax the fp8 filter (min_divisor, skip_first_last, exclude)" in line


# ------------------------------------------------ by how much an inconclusive one misses


def test_one_seed_gives_no_interval_and_the_distance_of_its_gap_to_the_limit() -> None:
    full = make_judged_fp8("balanced")
    records = tuple(r for r in full.records if r.policy != "fp8_rowwise" or r.seed == 0)
    j = Judged(full.contract, records, decide(records, full.contract, higher_is_better=False))
    line = next(ln for ln in _view(j).fp8 if ln.startswith("`fp8_rowwise`: gap"))
    assert "**inconclusive**" in line and "t-interval, 1 seeds" not in line
    assert "gap to `amp_bf16` +0.70% (1 seed); to `fp32` +0.40% (1 seed)" in line
    # gap to fp32 +0.40% (the verdict's, loss-gap against the baseline): 0.10 points under
    assert line.endswith(
        "against `fp32`: one seed gives no interval: its gap +0.40% is 0.10 points under "
        "the 0.50% limit; more seeds decide"
    )
    assert "it mean" not in line


def test_a_straddling_interval_gives_each_bound_in_points_against_the_verdicts_reference() -> None:
    gaps = {"amp_bf16": [-0.003] * 3, "fp8_rowwise": [0.001, 0.0015, 0.002]}
    j = make_judged_fp8("balanced", gaps=gaps)
    v = j.decision.verdicts["fp8_rowwise"]
    assert v.status == "inconclusive" and v.gate == "fp8-reference"
    gap = paired_interval(
        [(1 + g) / (1 + r) - 1 for g, r in zip(gaps["fp8_rowwise"], gaps["amp_bf16"], strict=True)],
        0.90,
    )
    assert gap.low < 0.005 < gap.high
    line = next(ln for ln in _view(j).fp8 if ln.startswith("`fp8_rowwise`: gap"))
    assert line.endswith(
        f"against `amp_bf16`: its 90% t-interval straddles the 0.50% limit: the high end "
        f"{gap.high:+.2%} is {100 * (gap.high - 0.005):.2f} points over it, the low end "
        f"{gap.low:+.2%} {100 * (0.005 - gap.low):.2f} points under (mean {gap.mean:+.2%})"
    )


def test_the_panel_draws_a_single_delayed_what_if_point() -> None:
    """Two sampled steps: the what-if is null at the first, so one point remains."""
    samples = [
        sample(step, "blocks.0.attn.c_proj", delayed=None if step == 0 else stats(saturated=25))
        for step in (0, 20)
    ]
    one = build_fp8_trace(samples)
    assert one is not None
    full = make_judged_fp8()
    records = tuple(
        dataclasses.replace(r, fp8_trace=one) if r.fp8_trace is not None else r
        for r in full.records
    )
    plt = plots._pyplot()
    colors = {r.policy: plots.policy_color(r.policy) for r in records}
    fig = plot_fp8(records, full.decision, colors, plt)
    assert fig is not None
    sat_ax = fig.axes[2]
    dashed = [ln for ln in sat_ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 2  # fp8_tensorwise and fp8_rowwise store traces
    for ln in dashed:
        assert list(ln.get_xdata()) == [20] and list(ln.get_ydata()) == [25.0]
        assert ln.get_marker() not in (None, "", "None", " ") and ln.get_markersize() > 0
    assert sat_ax.get_ylim()[1] >= 25.0
    plt.close(fig)
