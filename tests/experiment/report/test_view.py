"""The view model: every row, sentence and plot reference, computed once from a decision."""

from __future__ import annotations

import dataclasses

import pytest

from mixprec.experiment import RunRecord
from mixprec.experiment.report import (
    ReportView,
    build_view,
    decision_table,
    headline,
    verdict_label,
    verdict_reason,
)
from mixprec.experiment.report.view import COLUMNS, TABLE_NOTE

from .judged import CAP, STEPS, Judged

SETTINGS = {"steps": STEPS, "lr": 0.003, "batch_size": 64}


def _view(judged: Judged, **kw: object) -> ReportView:
    return build_view(
        judged.contract,
        judged.records,
        judged.decision,
        workload_description="8x8 digits, 10 classes",
        metric_name="macro_f1",
        settings=SETTINGS,
        **kw,  # type: ignore[arg-type]
    )


def test_rows_follow_the_decision_with_every_kind(judged: Judged) -> None:
    view = _view(judged)
    d = judged.decision
    assert [r.policy for r in view.table.rows] == [s.policy for s in d.summaries]
    kinds = {r.policy: r.kind for r in view.table.rows}
    assert kinds == {
        "fp32": "base",
        "bf16_master": "rec",
        "amp_bf16": "inconclusive",
        "amp_fp16": "eligible",
        "bf16_pure": "rejected",
    }
    for row in view.table.rows:
        assert row.label == verdict_label(row.policy, d)
        assert row.reason == verdict_reason(row.policy, d)
        assert row.verdict == row.label + (f": {row.reason}" if row.reason else "")
        assert len(row.cells) == len(COLUMNS) and row.cells[-1] == row.verdict


def test_cells_are_formatted_once(judged: Judged) -> None:
    rows = {r.policy: r for r in _view(judged).table.rows}
    base = judged.decision.summary("fp32")
    assert rows["fp32"].gap == f"seed spread {base.baseline_spread:.2%} (sd)"
    assert rows["amp_fp16"].steps == f"{CAP} of {STEPS}" and rows["fp32"].steps == str(STEPS)
    gap = judged.decision.summary("amp_bf16").gap
    assert rows["amp_bf16"].gap.startswith(f"{100 * gap.mean:+.2f}%")
    assert rows["bf16_pure"].frozen == "12.5%" and rows["bf16_pure"].seeds == "3"
    # The worst severity first, then by rule id.
    assert rows["bf16_pure"].doctor == "vanishing-updates (error), loss-scale-headroom (warning)"
    assert rows["fp32"].doctor == "-"


def test_headers_name_the_metric(judged: Judged) -> None:
    table = decision_table(judged.decision, judged.records, "macro_f1")
    assert table.headers == tuple("macro_f1" if c == "metric" else c for c in COLUMNS)
    assert table.note == TABLE_NOTE


def test_sentences_notes_and_findings(judged: Judged) -> None:
    view = _view(judged, notes=("ignored 2 record(s) of other policies or settings",))
    assert view.headline == headline(judged.decision) and view.recommended == "bf16_master"
    assert view.title == "mixprec compare: digits"
    assert view.settings_line == (
        "Settings: steps 50, lr 0.003, batch_size 64, optimizer adamw; seeds 3 (up to 3)."
    )
    assert view.gates_line.startswith("Gates: held-out loss gap per seed, paired with fp32")
    assert view.gates_line.endswith(".")
    assert view.observations[0] == "ignored 2 record(s) of other policies or settings"
    assert any(f"ran {CAP} of {STEPS} steps" in o for o in view.observations)
    # Three seeds report the same two findings: listed once each.
    assert [f.rule for f in view.doctor] == ["vanishing-updates", "loss-scale-headroom"]
    assert [f.applies_to for f in view.doctor] == ["bf16_pure", "bf16_pure"]


def test_plots_list_the_loss_scale_only_when_a_run_scaled(judged: Judged) -> None:
    view = _view(judged)
    assert [p.key for p in view.plots] == [
        "cost_quality", "loss", "heldout", "loss_scale", "memory", "step_time"
    ]  # fmt: skip
    assert all(p.path == f"plots/{p.key}.png" for p in view.plots)
    unscaled = [dataclasses.replace(r, loss_scale_trace=()) for r in judged.records]
    keys = [p.key for p in build_view(judged.contract, unscaled, judged.decision).plots]
    assert "loss_scale" not in keys and len(keys) == 5


def test_the_view_is_plain_frozen_data(judged: Judged) -> None:
    view = _view(judged)
    assert view == _view(judged)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.headline = "something else"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.table.rows[0].gap = "+0.00%"  # type: ignore[misc]


def test_hardware_and_pending_come_first(judged: Judged) -> None:
    from mixprec.experiment import decide
    from mixprec.experiment.hardware import DeviceFacts

    cpu = DeviceFacts(
        device_type="cpu", name="AMD EPYC", flags=("avx512f", "avx512_bf16"), bf16_fast=True,
        torch="2.13.0+cpu", threads=2,
    )  # fmt: skip
    records = [dataclasses.replace(r, device=cpu) for r in judged.records]
    view = build_view(
        judged.contract, records, decide(records, judged.contract, higher_is_better=True)
    )
    assert view.hardware_line == (
        "Measured on cpu AMD EPYC (avx512f, avx512_bf16; bf16 matmul accelerated, fp16 "
        "emulated), torch 2.13.0+cpu, 2 threads; fp32 (the baseline) trained at 104 steps/s "
        "(mean of 3 seeds)."
    )
    assert view.description == "Workload `digits --size tiny`."
    pending = dataclasses.replace(judged.contract, target_device="cuda")
    d = decide(records, pending, higher_is_better=True)
    view = build_view(pending, records, d)
    assert view.hardware_line.endswith("Target: cuda, not where these runs were measured.")
    assert view.headline.startswith("Pending a run on the target cuda: nothing is promoted.")
    assert view.status == "pending_target" and view.recommended is None
    rows = {r.policy: r for r in view.table.rows}
    assert rows["bf16_master"].label == "eligible, pending target"
    assert view.choice[0].startswith("Ranked by measured memory alone, relative to fp32: step")
    assert (
        view.choice[-1] == "Nothing is promoted: rerun this contract on cuda to rank by balanced."
    )


def test_staying_on_the_baseline_is_a_recommendation(judged: Judged) -> None:
    from mixprec.experiment import decide

    contract = dataclasses.replace(judged.contract, objective="speed")
    slow = [
        dataclasses.replace(r, throughput={"steps_per_s": 200.0 if r.policy == "fp32" else 50.0})
        for r in judged.records
    ]
    d = decide(slow, contract, higher_is_better=True)
    view = build_view(contract, slow, d)
    assert d.status == "stay" and view.recommended == "fp32"
    assert view.headline.startswith("Recommended: stay on **fp32** (objective speed")
    rows = {r.policy: r for r in view.table.rows}
    assert rows["fp32"].label == "baseline, RECOMMENDED (stay)"
    assert rows["bf16_master"].step_time == "4.00x" and rows["fp32"].step_time == "reference"
    assert view.choice[-1] == "Chosen: stay on `fp32` at 1.000, next `bf16_master` at 4.000."


def test_unsteady_step_times_are_said_where_the_choice_reads_them(judged: Judged) -> None:
    from mixprec.experiment import decide

    def busy(r: RunRecord) -> RunRecord:  # bf16_master's seed 1 timed under load
        slow = r.policy == "bf16_master" and r.seed == 1
        return dataclasses.replace(r, throughput={"steps_per_s": 40.0 if slow else 100.0})

    records = [busy(r) for r in judged.records]
    d = decide(records, judged.contract, higher_is_better=True)
    said = build_view(judged.contract, records, d).choice[-1]
    assert said.startswith("Step times were unsteady: step-time ratios varied over seeds")
    assert "90% intervals of their means" in said and "bf16_master" in said
    assert d.unsteady in said
    steady = decide(judged.records, judged.contract, higher_is_better=True)
    assert not any(
        "unsteady" in line for line in build_view(judged.contract, judged.records, steady).choice
    )
    by_memory = dataclasses.replace(judged.contract, objective="memory")
    d = decide(records, by_memory, higher_is_better=True)
    assert not any("unsteady" in line for line in build_view(by_memory, records, d).choice)


def test_a_tie_says_what_decided_it() -> None:
    from mixprec.experiment import decide
    from mixprec.experiment.report.wording import choice_lines

    from ..test_decision import contract, paired, rec

    records = [
        *paired("amp_bf16", [1.0, 1.0], [0.003, 0.003], total=500),
        *[rec("bf16_master", s, 1.001, total=505) for s in (0, 1)],
    ]
    d = decide(records, contract(candidates=("amp_bf16", "bf16_master")), higher_is_better=False)
    assert choice_lines(d)[-1] == (
        "Chosen: promote `bf16_master` at 0.505, next `amp_bf16` at 0.500 (tied within 2%: "
        "the smaller loss gap decided)."
    )
