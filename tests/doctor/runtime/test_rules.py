from __future__ import annotations

import pytest
import torch

from mixprec.doctor import UpdateStats
from mixprec.doctor.findings import Finding
from mixprec.doctor.runtime.hunter import NonfiniteHit
from mixprec.doctor.runtime.ledger import FindingLedger
from mixprec.doctor.runtime.measure import GradientStats, ScaledGradientChange, ZeroBreakdown
from mixprec.doctor.runtime.rules import (
    FP32_REPLAY,
    UNFAITHFUL_REPLAY_SHARE,
    clip_before_unscale,
    gradient_underflow,
    nonfinite_source,
    vanishing_updates,
)
from mixprec.dtypes import format_info


def test_clip_without_a_finite_norm_still_reports() -> None:
    change = ScaledGradientChange(caller="train.py:7", grad_norm=float("inf"))
    f = clip_before_unscale(change, step=3, loss_scale=1024.0)
    assert f.where == "train.py:7" and "far tighter" in f.message
    assert "scaled_grad_norm" not in f.evidence
    g = clip_before_unscale(
        ScaledGradientChange(caller="t.py:1", grad_norm=0.5), step=0, loss_scale=4.0
    )
    assert g.evidence["scaled_grad_norm"] == 2.0 and g.evidence["grad_norm"] == 0.5
    assert "scaled norm of 2" in g.message


def test_nonfinite_input_points_at_the_data() -> None:
    hit = NonfiniteHit(
        module="embed",
        module_type="Embedding",
        inputs_finite=False,
        nonfinite_elements=3,
        has_nan=True,
        output_dtype="float32",
    )
    f = nonfinite_source(hit, step=5, first_nonfinite_step=4, compute=torch.float32)
    assert f.severity == "error" and "inputs were already non-finite" in f.message
    assert "input batch" in f.fix and f.evidence["first_nonfinite_step"] == 4


def test_vanishing_updates_severity_and_threshold() -> None:
    common = {
        "step": 0,
        "where": "w",
        "dtype": torch.bfloat16,
        "param_dtypes": ["bf16"],
        "master_updates": None,
        "threshold": 0.05,
    }
    assert (
        vanishing_updates(UpdateStats(intended=100, vanished=4), worst_fraction=0.04, **common)
        is None
    )  # type: ignore[arg-type]
    warn = vanishing_updates(UpdateStats(intended=100, vanished=20), worst_fraction=0.2, **common)  # type: ignore[arg-type]
    assert warn is not None and warn.severity == "warning"
    err = vanishing_updates(UpdateStats(intended=10, vanished=10), worst_fraction=1.0, **common)  # type: ignore[arg-type]
    assert err is not None and err.severity == "error"
    assert err.evidence["lost_update_below_at_1"] == format_info("bf16").min_update_at_one


_STATS = GradientStats(
    reference="fp16", elements=1000, zeros=300, underflow=0, flush=0, overflow=0, nonfinite=0
)


def _split(
    structural: int, underflow: int, only_ref: int = 0, at_outputs: int = 0
) -> ZeroBreakdown:
    return ZeroBreakdown(
        elements=1000,
        zeros=structural + underflow + at_outputs,
        structural=structural,
        underflow=underflow,
        at_outputs=at_outputs,
        reference_nonzero=1000 - structural - at_outputs - only_ref,
        reference_only_zero=only_ref,
        largest_lost=1e-8,
    )


def _fp16(
    split: ZeroBreakdown | None,
    *,
    scales: bool,
    reference: str = "",
    output_grads: GradientStats | None = None,
) -> Finding | None:
    return gradient_underflow(
        _STATS,
        step=4,
        compute=torch.float16,
        scales=scales,
        loss_scale=65536.0 if scales else None,
        fp16_in_use=False,
        zero_threshold=0.05,
        underflow_threshold=0.01,
        zero_breakdown=split,
        output_grads=output_grads,
        reference=FP32_REPLAY if split is not None else reference,
    )


def test_structural_zeros_alone_are_not_gradient_underflow() -> None:
    assert _fp16(_split(structural=300, underflow=0), scales=True) is None
    assert _fp16(_split(structural=300, underflow=0), scales=False) is None
    # The share is of the elements non-zero in fp32 (1000 - structural): 36 of 736 is
    # under 5%, 37 of 737 is not.
    assert _fp16(_split(structural=264, underflow=36), scales=False) is None
    f = _fp16(_split(structural=263, underflow=37), scales=False)
    assert f is not None and f.severity == "error"
    assert f.evidence["fraction"] == f.evidence["underflow_zero_fraction"] == 37 / 737
    assert (f.evidence["underflow_zeros"], f.evidence["structural_zeros"]) == (37, 263)
    assert f.evidence["reference"] == FP32_REPLAY and f.evidence["unsplit_zeros"] == 0
    scaled = _fp16(_split(structural=200, underflow=100), scales=True)
    assert scaled is not None and scaled.severity == "warning"
    assert "loss scale is too low" in scaled.fix and "200 zero elements" in scaled.message


def _outputs(elements: int, zeros: int, subnormal: int) -> GradientStats:
    return GradientStats(
        reference="fp16",
        elements=elements,
        zeros=zeros,
        underflow=0,
        flush=subnormal,
        overflow=0,
        nonfinite=0,
    )


def test_zeros_behind_a_flushed_loss_gradient_are_lost() -> None:
    split = _split(structural=100, underflow=0, at_outputs=200)
    # Every element of the loss's gradient into the fp16 outputs flushed: lost.
    f = _fp16(split, scales=False, output_grads=_outputs(640, 640, 0))
    assert f is not None and f.severity == "error"
    assert f.evidence["fraction"] == 200 / 900 and f.evidence["output_gradient_flushed"]
    assert f.evidence["at_output_zeros"] == 200 and "flushed in its cast" in f.message
    # Zeros beside subnormals: the loss's gradient reached below fp16's range.
    partly = _fp16(split, scales=True, output_grads=_outputs(640, 500, 60))
    assert partly is not None and partly.severity == "warning"
    # Zeros beside normal-range values only: a loss that ignores those outputs.
    assert _fp16(split, scales=True, output_grads=_outputs(640, 320, 0)) is None
    assert _fp16(split, scales=True, output_grads=None) is None


def test_without_a_faithful_split_zeros_are_information() -> None:
    f = _fp16(None, scales=True, reference="no model")
    assert f is not None and f.severity == "info" and f.evidence["reference"] == "no model"
    assert f.evidence["fraction"] == 0.3 and "no model" in f.message
    only_ref = int(UNFAITHFUL_REPLAY_SHARE * 1000) + 1
    g = _fp16(_split(structural=0, underflow=300, only_ref=only_ref), scales=False)
    assert g is not None and g.severity == "info"
    assert "not the same step" in g.evidence["reference"]
    assert g.evidence["unfaithful_replay"]["reference_only_zero"] == only_ref


def test_the_ledger_keeps_the_most_severe_then_the_largest() -> None:
    info = _fp16(None, scales=False, reference="not recorded")
    small = _fp16(_split(structural=250, underflow=50), scales=False)
    large = _fp16(_split(structural=0, underflow=300), scales=False)
    assert info is not None and small is not None and large is not None
    ledger = FindingLedger()
    ledger.record(0, 0.3, info)
    ledger.record(1, 50 / 750, small)  # an error outranks a larger info share
    ledger.record(2, 0.01, info)
    (f,) = ledger.findings()
    assert f.severity == "error" and f.evidence["underflow_zeros"] == 50
    assert (f.evidence["first_step"], f.evidence["last_step"], f.evidence["times_seen"]) == (
        0,
        2,
        3,
    )
    ledger.record(3, 0.3, large)
    assert ledger.findings()[0].evidence["underflow_zeros"] == 300


@pytest.mark.parametrize("severity", ["warning", "info"])
def test_other_compute_dtypes_judge_values_below_the_subnormal(severity: str) -> None:
    stats = GradientStats(
        reference="fp16", elements=100, zeros=50, underflow=2, flush=3, overflow=0, nonfinite=0
    )
    f = gradient_underflow(
        stats,
        step=0,
        compute=torch.bfloat16,
        scales=False,
        loss_scale=None,
        fp16_in_use=severity == "warning",
        zero_threshold=0.05,
        underflow_threshold=0.01,
    )
    assert f is not None and f.severity == severity and f.evidence["fraction"] == 0.02


def test_vanishing_updates_fix_names_the_master_for_the_optimizer_at_hand() -> None:
    """Found in issue 34: the fix told every optimizer to use mixprec.optim.AdamW."""
    common = {
        "step": 0,
        "where": "w",
        "dtype": torch.bfloat16,
        "param_dtypes": ["bf16"],
        "master_updates": None,
        "threshold": 0.05,
        "worst_fraction": 1.0,
    }
    stats = UpdateStats(intended=10, vanished=10)
    sgd = vanishing_updates(stats, optimizer="torch.optim.SGD", **common)  # type: ignore[arg-type]
    assert sgd is not None and "mixprec.optim.SGD(params, ..., master='exact')" in sgd.fix
    assert "AdamW" not in sgd.fix
    muon = vanishing_updates(stats, optimizer="torch.optim.Muon", **common)  # type: ignore[arg-type]
    assert muon is not None and "mixprec.optim.Mastered(torch.optim.Muon" in muon.fix
