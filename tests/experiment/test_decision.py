from __future__ import annotations

import math
from typing import Any

import pytest

from mixprec.experiment.contract import Contract, Gates
from mixprec.experiment.decision import decide
from mixprec.experiment.records import RunRecord


def rec(policy: str, seed: int, loss: float, **kw: Any) -> RunRecord:
    base: dict[str, Any] = dict(
        workload="w",
        size="s",
        policy=policy,
        policy_fields={},
        seed=seed,
        steps=kw.pop("steps", 100),
        fingerprint="f",
        heldout_loss=loss,
        metric=1.0 / loss,
        metric_name="m",
        bytes={"total": kw.pop("total", 1000)},
        throughput={"steps_per_s": kw.pop("speed", 10.0)},
    )
    base.update(kw)
    return RunRecord(**base)


def contract(**kw: Any) -> Contract:
    return Contract(
        workload="digits", baseline="fp32", candidates=("amp_bf16", "bf16_master", "amp_fp16"), **kw
    )


def test_small_gap_is_eligible_and_cheapest_is_recommended() -> None:
    records = [
        rec("fp32", 0, 1.00),
        rec("fp32", 1, 1.01),
        rec("amp_bf16", 0, 1.001, total=900),
        rec("amp_bf16", 1, 1.011, total=900),
        rec("bf16_master", 0, 1.002, total=700),
        rec("bf16_master", 1, 1.012, total=700),
        rec("amp_fp16", 0, 1.0, total=900),
        rec("amp_fp16", 1, 1.01, total=900),
    ]
    d = decide(records, contract(), higher_is_better=True)
    assert d.baseline_ok and d.eligible == ("amp_bf16", "bf16_master", "amp_fp16")
    assert d.recommended == "bf16_master"
    assert d.success


def test_gap_beyond_threshold_and_noise_rejects() -> None:
    records = [
        rec("fp32", 0, 1.000),
        rec("fp32", 1, 1.002),
        rec("amp_bf16", 0, 1.011),
        rec("amp_bf16", 1, 1.013),  # +1.1%, noise 0.1%
        rec("bf16_master", 0, 1.0002),
        rec("bf16_master", 1, 1.0022),
        rec("amp_fp16", 0, 1.0),
        rec("amp_fp16", 1, 1.002),
    ]
    d = decide(records, contract(gates=Gates(max_rel_loss_gap=0.005)), higher_is_better=True)
    assert "amp_bf16" in d.rejected and "+1.10%" in d.rejected["amp_bf16"]
    assert d.eligible == ("bf16_master", "amp_fp16")


def test_gap_within_seed_noise_is_not_called_a_regression() -> None:
    records = [
        rec("fp32", 0, 1.00),
        rec("fp32", 1, 1.10),  # 4.8% half-range noise
        rec("amp_bf16", 0, 1.02),
        rec("amp_bf16", 1, 1.12),  # +2% gap
        rec("bf16_master", 0, 1.0),
        rec("bf16_master", 1, 1.1),
        rec("amp_fp16", 0, 1.0),
        rec("amp_fp16", 1, 1.1),
    ]
    d = decide(
        records,
        contract(gates=Gates(max_rel_loss_gap=0.005, noise_multiplier=2.0)),
        higher_is_better=True,
    )
    assert "amp_bf16" in d.eligible
    assert "within" in d.notes["amp_bf16"]


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        (dict(skipped_steps=10), "10.0% of steps skipped"),
        (dict(nonfinite_steps=2), "2 non-finite-loss steps"),
        (dict(status="failed", error="PrecisionError: collapse"), "run failed"),
    ],
)
def test_gates_reject_with_reason(kw: dict[str, Any], fragment: str) -> None:
    records = [
        rec("fp32", 0, 1.0),
        rec("amp_bf16", 0, 1.0),
        rec("bf16_master", 0, 1.0),
        rec("amp_fp16", 0, 1.0, **kw),
    ]
    d = decide(records, contract(seeds=1), higher_is_better=True)
    assert fragment in d.rejected["amp_fp16"]
    assert "amp_fp16" not in d.eligible


def test_metric_threshold_respects_direction() -> None:
    records = [
        rec("fp32", 0, 1.0, metric=0.9),
        rec("amp_bf16", 0, 1.0, metric=0.5),
        rec("bf16_master", 0, 1.0, metric=0.95),
        rec("amp_fp16", 0, 1.0, metric=0.91),
    ]
    d = decide(records, contract(seeds=1, gates=Gates(metric_threshold=0.8)), higher_is_better=True)
    assert "misses >= 0.8" in d.rejected["amp_bf16"]
    d2 = decide(
        records, contract(seeds=1, gates=Gates(metric_threshold=0.8)), higher_is_better=False
    )
    assert not d2.baseline_ok and "misses <= 0.8" in d2.baseline_reason


def test_failed_baseline_fails_everything() -> None:
    records = [
        rec("fp32", 0, math.nan, status="failed", error="boom"),
        rec("amp_bf16", 0, 1.0),
        rec("bf16_master", 0, 1.0),
        rec("amp_fp16", 0, 1.0),
    ]
    d = decide(records, contract(seeds=1), higher_is_better=True)
    assert not d.baseline_ok and d.recommended is None and not d.success
    assert all("baseline failed" in v for v in d.rejected.values())


def test_no_eligible_candidate() -> None:
    records = [rec("fp32", 0, 1.0)] + [
        rec(p, 0, 2.0) for p in ("amp_bf16", "bf16_master", "amp_fp16")
    ]
    d = decide(records, contract(seeds=1), higher_is_better=True)
    assert d.baseline_ok and not d.eligible and d.recommended is None and not d.success


def test_speed_breaks_memory_ties() -> None:
    records = [
        rec("fp32", 0, 1.0),
        rec("amp_bf16", 0, 1.0, total=700, speed=5.0),
        rec("bf16_master", 0, 1.0, total=705, speed=9.0),
        rec("amp_fp16", 0, 1.0, total=900, speed=20.0),
    ]
    d = decide(records, contract(seeds=1), higher_is_better=True)
    assert d.recommended == "bf16_master"


def test_contract_validation() -> None:
    with pytest.raises(ValueError, match="unknown precision policy 'nope'"):
        Contract(candidates=("nope",))
    with pytest.raises(ValueError, match="also listed as a candidate"):
        Contract(candidates=("fp32",))
    with pytest.raises(ValueError, match="unknown contract keys \\['stepz'\\]"):
        Contract.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match="unknown gate keys"):
        Contract.from_dict({"gates": {"max_gap": 1}})
    c = Contract.from_dict(
        {"candidates": "amp_bf16, bf16_master", "gates": {"max_rel_loss_gap": 0.01}}
    )
    assert c.candidates == ("amp_bf16", "bf16_master") and c.gates.max_rel_loss_gap == 0.01
    assert Contract.from_dict(c.to_dict()) == c
    assert c.run_fingerprint("amp_bf16", 0) != c.run_fingerprint("amp_bf16", 1)
    assert c.run_fingerprint("amp_bf16", 0) == Contract.from_dict(c.to_dict()).run_fingerprint(
        "amp_bf16", 0
    )


def test_capped_run_is_compared_at_its_own_step() -> None:
    curve0, curve1 = [[100, 1.50], [500, 1.0]], [[100, 1.52], [500, 1.01]]
    records = [
        rec("fp32", 0, 1.00, eval_curve=curve0, steps=500),
        rec("fp32", 1, 1.01, eval_curve=curve1, steps=500),
        rec("amp_bf16", 0, 1.0, steps=500),
        rec("amp_bf16", 1, 1.01, steps=500),
        rec("bf16_master", 0, 1.0, steps=500),
        rec("bf16_master", 1, 1.01, steps=500),
        # Stopped at step 100: 1.50 and 1.52 are the baseline's losses there, not 1.0.
        rec("amp_fp16", 0, 1.501, steps=100),
        rec("amp_fp16", 1, 1.521, steps=100),
    ]
    d = decide(records, contract(), higher_is_better=True)
    fp16 = next(s for s in d.summaries if s.policy == "amp_fp16")
    assert fp16.steps == 100 and abs(fp16.rel_gap) < 1e-3
    assert "amp_fp16" in d.eligible
    worse = [*records[:6], rec("amp_fp16", 0, 1.60, steps=100), rec("amp_fp16", 1, 1.62, steps=100)]
    assert "amp_fp16" in decide(worse, contract(), higher_is_better=True).rejected


def test_step_caps_validation() -> None:
    with pytest.raises(ValueError, match="not a candidate"):
        Contract(candidates=("amp_bf16",), step_caps={"amp_fp16": 10})
    with pytest.raises(ValueError, match="must be an int >= 1"):
        Contract(candidates=("amp_fp16",), step_caps={"amp_fp16": 0})
    c = Contract.from_dict({"candidates": ["amp_fp16"], "step_caps": {"amp_fp16": 5}})
    assert Contract.from_dict(c.to_dict()) == c
