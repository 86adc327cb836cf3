"""FP8 candidates are judged against the best 16-bit policy too (constructed records)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mixprec.experiment.contract import Contract
from mixprec.experiment.decision import decide
from mixprec.experiment.fp8_gate import FP8_GATE, emulated_fp8, unconverted_fp8
from mixprec.experiment.records import RunRecord

from .test_decision import rec

FP8 = {"fp8": {"recipe": "tensorwise"}}
BASE = [1.00, 1.02, 0.99]


def runs(policy: str, gaps: list[float], **kw: Any) -> list[RunRecord]:
    """`policy`'s records, `gaps` above fp32's `BASE` losses seed by seed."""
    if policy.startswith("fp8"):
        kw.setdefault("policy_fields", FP8)
    return [
        rec(policy, i, b * (1 + g), **kw) for i, (b, g) in enumerate(zip(BASE, gaps, strict=True))
    ]


def fp32() -> list[RunRecord]:
    return [rec("fp32", i, b) for i, b in enumerate(BASE)]


def contract(**kw: Any) -> Contract:
    kw.setdefault("candidates", ("amp_bf16", "bf16_master", "fp8_tensorwise"))
    return Contract(workload="digits", baseline="fp32", seeds=3, max_seeds=3, **kw)


def test_fp8_within_the_fp32_gap_but_worse_than_bf16_is_rejected_against_bf16() -> None:
    records = fp32() + runs("amp_bf16", [-0.004, -0.005, -0.004], total=800)
    records += runs("bf16_master", [0.0, 0.001, 0.0], total=700)
    records += runs("fp8_tensorwise", [0.003, 0.004, 0.003], total=600)
    d = decide(records, contract(objective="memory"), higher_is_better=False)
    v = d.verdicts["fp8_tensorwise"]
    # Against fp32 alone it would pass (+0.3-0.4% < 0.5%); the reference is bf16_master,
    # the best eligible 16-bit policy under the memory objective, and that gap is ~0.34%.
    assert d.fp8_reference == "bf16_master"
    assert v.status == "eligible" and v.gate == FP8_GATE, v.reason
    assert "to bf16_master" in v.reason and "against fp32" in v.reason
    c = contract(objective="memory", baseline_for_fp8="amp_bf16")
    d = decide(records, c, higher_is_better=False)
    v = d.verdicts["fp8_tensorwise"]
    assert d.fp8_reference == "amp_bf16"
    assert v.status == "rejected" and v.gate == FP8_GATE, v.reason
    assert "gap to amp_bf16" in v.reason and "on the whole interval" in v.reason
    assert d.recommended == "bf16_master"


def test_an_fp8_candidate_that_holds_against_bf16_can_be_recommended() -> None:
    records = fp32() + runs("amp_bf16", [0.0, 0.001, 0.0], total=800)
    records += runs("fp8_tensorwise", [0.001, 0.002, 0.001], total=600)
    d = decide(
        records,
        contract(candidates=("amp_bf16", "fp8_tensorwise"), objective="memory"),
        higher_is_better=False,
    )
    assert d.fp8_reference == "amp_bf16"
    assert d.verdicts["fp8_tensorwise"].status == "eligible"
    assert d.recommended == "fp8_tensorwise"
    assert d.to_dict()["fp8_reference"] == "amp_bf16"


def test_without_an_eligible_16bit_policy_fp8_is_not_judged() -> None:
    records = fp32() + runs("amp_bf16", [0.02, 0.03, 0.025])
    records += runs("fp8_tensorwise", [0.0, 0.001, 0.0], total=600)
    d = decide(records, contract(candidates=("amp_bf16", "fp8_tensorwise")), higher_is_better=False)
    v = d.verdicts["fp8_tensorwise"]
    assert v.status == "rejected" and v.gate == FP8_GATE
    assert "no 16-bit candidate passed the gates (amp_bf16 rejected)" in v.reason
    assert "add amp_bf16" not in v.reason, "it is a candidate already"
    assert d.fp8_reference is None and d.fp8_note
    assert d.status == "stay" and d.recommended == "fp32"  # no candidate is eligible
    only = decide(
        fp32() + runs("fp8_tensorwise", [0.0, 0.001, 0.0]),
        contract(candidates=("fp8_tensorwise",)),
        higher_is_better=False,
    )
    assert "the contract has no 16-bit candidate" in only.verdicts["fp8_tensorwise"].reason


def test_a_named_reference_that_failed_says_so() -> None:
    records = fp32() + runs("amp_bf16", [0.02, 0.03, 0.025])
    records += runs("bf16_master", [0.0, 0.0, 0.0], total=700)
    records += runs("fp8_tensorwise", [0.0, 0.001, 0.0], total=600)
    d = decide(records, contract(baseline_for_fp8="amp_bf16"), higher_is_better=False)
    v = d.verdicts["fp8_tensorwise"]
    assert v.status == "rejected" and "baseline_for_fp8 amp_bf16 is rejected" in v.reason


def test_fp8_that_fails_against_fp32_keeps_that_verdict() -> None:
    records = fp32() + runs("amp_bf16", [0.0, 0.0, 0.0])
    records += runs("fp8_tensorwise", [0.05, 0.06, 0.05])
    d = decide(records, contract(candidates=("amp_bf16", "fp8_tensorwise")), higher_is_better=False)
    assert d.verdicts["fp8_tensorwise"].gate == "loss-gap"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("bf16_lean", r"baseline_for_fp8 'bf16_lean' is not a 16-bit candidate"),
        ("fp8_tensorwise", r"baseline_for_fp8 'fp8_tensorwise' is not a 16-bit candidate"),
        ("", r"baseline_for_fp8 '' is not a policy name"),
        ("nosuch", r"baseline_for_fp8 'nosuch': unknown precision policy 'nosuch'"),
        (3, r"baseline_for_fp8 3 is not a policy name"),
    ],
)
def test_baseline_for_fp8_must_be_a_16bit_candidate(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        contract(baseline_for_fp8=value)


def test_baseline_for_fp8_is_a_decision_key_and_an_alias_resolves() -> None:
    c = contract(baseline_for_fp8="bf16-mixed")
    assert c.baseline_for_fp8 == "amp_bf16"
    assert c.run_fingerprint("fp32", 0) == contract().run_fingerprint("fp32", 0)
    assert Contract.from_dict(c.to_dict()) == c
    assert "baseline_for_fp8" not in contract().to_dict()


def test_baseline_for_fp8_without_any_16bit_candidate_offers_no_empty_list() -> None:
    with pytest.raises(ValueError) as info:
        contract(candidates=("fp8_rowwise",), baseline_for_fp8="amp_bf16")
    assert str(info.value) == (
        "baseline_for_fp8 'amp_bf16' is not a 16-bit candidate of this contract: add it to "
        "the candidates"
    )


# ------------------------------------------------------- emulated FP8 step times

EMULATED = {"fp8": {"recipe": "tensorwise", "emulate": True}}
REAL = {"fp8": {"recipe": "tensorwise", "emulate": False}}


def fp8_speed_records(fp8_effective: dict[str, Any]) -> list[RunRecord]:
    """fp32 at 10 steps/s; amp_bf16 (0.8 of its memory) at 9; fp8 (0.6) at 4: emulated,
    2.5x fp32's step time."""
    records = fp32() + runs("amp_bf16", [0.0, 0.001, 0.0], total=800, speed=9.0)
    records += runs(
        "fp8_tensorwise", [0.001, 0.002, 0.001], total=600, speed=4.0, effective=fp8_effective
    )
    return records


def two(objective: str, **kw: Any) -> Contract:
    return contract(candidates=("amp_bf16", "fp8_tensorwise"), objective=objective, **kw)


@pytest.mark.parametrize("objective", ["speed", "balanced"])
def test_emulated_fp8_is_not_ranked_on_its_step_time(objective: str) -> None:
    d = decide(fp8_speed_records(EMULATED), two(objective), higher_is_better=False)
    v = d.verdicts["fp8_tensorwise"]
    assert v.status == "eligible" and v.gate == FP8_GATE  # the quality verdict stands
    assert d.speed_pending == ("fp8_tensorwise",) and d.emulated == ("fp8_tensorwise",)
    assert [st.policy for st in d.ranking] == (
        ["fp32", "amp_bf16"] if objective == "speed" else ["amp_bf16", "fp32"]
    )
    assert d.recommended == ("fp32" if objective == "speed" else "amp_bf16")
    note = d.notes["fp8_tensorwise"]
    assert note.startswith("speed pending a run on FP8 hardware (CUDA capability 8.9+)")
    assert d.to_dict()["speed_pending"] == ["fp8_tensorwise"]
    # Measured on FP8 hardware, the same figures rank (balanced: 0.6 x 2.5 = 1.5, behind
    # amp_bf16's 0.8 x 1.11 = 0.89 and fp32's 1.0)
    real = decide(fp8_speed_records(REAL), two(objective), higher_is_better=False)
    assert real.speed_pending == () and real.emulated == ()
    assert [st.policy for st in real.ranking][-1] == "fp8_tensorwise"


def test_emulated_fp8_is_not_rejected_by_max_slowdown() -> None:
    c = two("balanced", max_slowdown=1.5)
    d = decide(fp8_speed_records(EMULATED), c, higher_is_better=False)
    assert d.verdicts["fp8_tensorwise"].status == "eligible"
    assert d.verdicts["amp_bf16"].status == "eligible"  # 1.25x <= 1.5
    real = decide(fp8_speed_records(REAL), c, higher_is_better=False)
    v = real.verdicts["fp8_tensorwise"]
    assert v.status == "rejected" and v.gate == "slowdown" and "step time 2.50x" in v.reason


def test_under_the_memory_objective_emulated_fp8_ranks_on_memory() -> None:
    d = decide(fp8_speed_records(EMULATED), two("memory"), higher_is_better=False)
    assert d.speed_pending == () and d.emulated == ("fp8_tensorwise",)
    assert d.recommended == "fp8_tensorwise"
    assert "fp8_tensorwise" not in d.notes


def test_budgets_judge_emulated_fp8_and_its_reference_as_usual() -> None:
    records = fp32() + runs("fp8_tensorwise", [0.001, 0.002, 0.001], total=600, speed=4.0)
    records = [
        r if r.policy != "fp8_tensorwise" else dataclasses.replace(r, effective=EMULATED)
        for r in records
    ]
    records += runs("amp_bf16", [0.0, 0.001, 0.0], total=900, speed=8.0)
    c = two("speed", memory_budget=850)  # fp32 (1000) and amp_bf16 (900) over it
    d = decide(records, c, higher_is_better=False)
    assert d.verdicts["amp_bf16"].gate == "memory-budget"
    assert d.fp8_reference is None  # no eligible 16-bit policy: fp8 is not judged
    c = two("speed", memory_budget=950)  # only fp32 over it
    d = decide(records, c, higher_is_better=False)
    assert d.fp8_reference == "amp_bf16" and d.recommended == "amp_bf16"
    assert d.speed_pending == ("fp8_tensorwise",)


UNCONVERTED = {"fp8": {"recipe": "tensorwise", "emulate": True, "converted": [], "kept": []}}


@pytest.mark.parametrize("objective", ["speed", "balanced"])
def test_an_fp8_policy_that_converted_no_layer_is_not_emulated_fp8(objective: str) -> None:
    records = fp8_speed_records(UNCONVERTED)
    assert unconverted_fp8(records, ("amp_bf16", "fp8_tensorwise")) == ("fp8_tensorwise",)
    assert emulated_fp8(records, ("fp8_tensorwise",)) == ()
    d = decide(records, two(objective), higher_is_better=False)
    # it trained in 16 bits: its step times are real and rank (no speed pending) ...
    assert d.emulated == () and d.speed_pending == ()
    assert "fp8_tensorwise" in [st.policy for st in d.ranking]
    # ... and it still meets the FP8 gate: the user named an FP8 policy
    assert d.verdicts["fp8_tensorwise"].gate == FP8_GATE and d.fp8_reference == "amp_bf16"
    # records of an earlier mixprec (no `converted`) stay emulated FP8
    assert emulated_fp8(fp8_speed_records(EMULATED), ("fp8_tensorwise",)) == ("fp8_tensorwise",)
    assert unconverted_fp8(fp8_speed_records(EMULATED), ("fp8_tensorwise",)) == ()
