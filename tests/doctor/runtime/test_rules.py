from __future__ import annotations

import torch

from mixprec.doctor import UpdateStats
from mixprec.doctor.runtime.hunter import NonfiniteHit
from mixprec.doctor.runtime.measure import ScaledGradientChange
from mixprec.doctor.runtime.rules import (
    clip_before_unscale,
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
