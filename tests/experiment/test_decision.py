"""The decision on constructed records: paired gaps, intervals, the update path, length."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from mixprec.experiment.contract import Contract
from mixprec.experiment.decision import decide
from mixprec.experiment.gates import Gates
from mixprec.experiment.hardware import DeviceFacts
from mixprec.experiment.records import RunRecord
from mixprec.experiment.summary import tail_start

STEPS = 100

#: Relative improvement of the baseline over its last fifth in `rec`'s default curve
#: (well under the default limit of 0.75%).
SETTLED_TAIL = 0.001
#: Relative improvement from step 0 in `rec`'s default curve (well over the 5% floor).
TRAINED = 1.0


def rec(policy: str, seed: int, loss: float, **kw: Any) -> RunRecord:
    """A run record; its eval curve shows a settled last fifth unless given."""
    steps = kw.pop("steps", STEPS)
    base: dict[str, Any] = dict(
        workload="w",
        size="s",
        policy=policy,
        policy_fields={},
        seed=seed,
        steps=steps,
        fingerprint="f",
        heldout_loss=loss,
        metric=1.0 / loss if loss else math.nan,
        metric_name="m",
        bytes={"total": kw.pop("total", 1000)},
        throughput=kw.pop("throughput", {"steps_per_s": kw.pop("speed", 10.0)}),
        eval_curve=[
            [0, loss + abs(loss) * TRAINED],
            [tail_start(steps), loss + abs(loss) * SETTLED_TAIL],
            [steps, loss],
        ],
    )
    base.update(kw)
    return RunRecord(**base)


def contract(**kw: Any) -> Contract:
    """A contract judged in one look at its seeds (``max_seeds`` = ``seeds`` unless given)."""
    kw.setdefault("candidates", ("amp_bf16", "bf16_master", "amp_fp16"))
    kw.setdefault("max_seeds", kw.get("seeds", 2))
    return Contract(workload="digits", baseline="fp32", **kw)


def paired(
    candidate: str, base_losses: list[float], gaps: list[float], **kw: Any
) -> list[RunRecord]:
    """Baseline records with `base_losses` and `candidate` records `gaps` above them."""
    out = [rec("fp32", i, b) for i, b in enumerate(base_losses)]
    out += [
        rec(candidate, i, b * (1 + g), **kw)
        for i, (b, g) in enumerate(zip(base_losses, gaps, strict=True))
    ]
    return out


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
    assert "<= 0.50%" in d.verdicts["bf16_master"].reason


@pytest.mark.parametrize("spread", [0.0, 0.05, 0.17, 0.5])
def test_worse_on_every_seed_is_rejected_whatever_the_absolute_spread(spread: float) -> None:
    """The issue's digits case: the old gate read the spread of absolute losses (+-17%)."""
    base = [1.0 * (1 - spread), 1.0, 1.0 * (1 + spread)]
    records = paired("amp_bf16", base, [0.030, 0.035, 0.040])
    d = decide(records, contract(candidates=("amp_bf16",)), higher_is_better=True)
    v = d.verdicts["amp_bf16"]
    assert v.status == "rejected" and v.gate == "loss-gap", v
    # No candidate is eligible and fp32 keeps every budget: stay on it (exit 0).
    assert d.recommended == "fp32" and d.status == "stay"
    s = d.summary("amp_bf16")
    assert s.gap.low > 0.005 and s.gap.n == 3
    # The baseline's own spread is reported beside the gap, not used as its noise.
    assert d.summary("fp32").baseline_spread == pytest.approx(spread, rel=1e-6, abs=1e-12)


def test_issue_digits_gaps_are_never_eligible() -> None:
    """bf16_pure's gaps seen on digits with 3 seeds: +6.2%, +6.1%, +1.9%."""
    records = paired("amp_bf16", [0.080, 0.104, 0.113], [0.062, 0.061, 0.019])
    d = decide(records, contract(candidates=("amp_bf16",)), higher_is_better=True)
    assert d.verdicts["amp_bf16"].status == "rejected"
    assert "amp_bf16" not in d.eligible


def test_straddling_interval_is_inconclusive_and_never_recommended() -> None:
    records = paired("amp_bf16", [1.0, 1.0, 1.0], [-0.01, 0.004, 0.02])
    c = contract(candidates=("amp_bf16",), seeds=3, max_seeds=3)
    d = decide(records, c, higher_is_better=True)
    v = d.verdicts["amp_bf16"]
    assert v.status == "inconclusive" and "straddles 0.50% at max_seeds=3" in v.reason
    assert d.inconclusive == {"amp_bf16": v.reason}
    # Never promoted: fp32 stays (the inconclusive candidate is not proven).
    assert d.recommended == "fp32" and d.status == "stay"
    more = decide(
        records, contract(candidates=("amp_bf16",), seeds=3, max_seeds=5), higher_is_better=True
    )
    assert "more seeds needed" in more.verdicts["amp_bf16"].reason


def test_one_seed_gives_no_interval_so_no_eligibility() -> None:
    records = paired("amp_bf16", [1.0], [0.0])
    d = decide(records, contract(candidates=("amp_bf16",), seeds=1), higher_is_better=True)
    assert d.verdicts["amp_bf16"].status == "inconclusive"
    assert "(1 seed)" in d.verdicts["amp_bf16"].reason


def test_better_candidate_is_eligible() -> None:
    records = paired("amp_bf16", [1.0, 1.1], [-0.02, -0.021])
    d = decide(records, contract(candidates=("amp_bf16",)), higher_is_better=True)
    assert d.eligible == ("amp_bf16",)


def _update_error(rule: str) -> dict[str, Any]:
    return {"rule": rule, "severity": "error", "where": "w", "message": f"{rule} happened"}


def test_update_path_error_rejects_unless_acknowledged() -> None:
    doctor = [_update_error("optimizer-state-16bit"), _update_error("vanishing-updates")]
    records = paired("bf16_pure", [1.0, 1.2], [0.0, 0.0], doctor=doctor)
    c = contract(candidates=("bf16_pure",))
    v = decide(records, c, higher_is_better=True).verdicts["bf16_pure"]
    assert v.status == "rejected" and v.gate == "update-path"
    assert "optimizer-state-16bit (error)" in v.reason and "vanishing-updates" in v.reason
    partly = contract(candidates=("bf16_pure",), allow=("optimizer-state-16bit",))
    v = decide(records, partly, higher_is_better=True).verdicts["bf16_pure"]
    assert v.gate == "update-path" and v.reason.startswith("doctor vanishing-updates")
    assert v.acknowledged == ("optimizer-state-16bit",)
    both = contract(candidates=("bf16_pure",), allow="optimizer-state-16bit,vanishing-updates")
    d = decide(records, both, higher_is_better=True)
    assert d.verdicts["bf16_pure"].status == "eligible"
    assert "acknowledged" in d.notes["bf16_pure"]


def test_warnings_and_other_rules_do_not_reject() -> None:
    doctor = [
        {"rule": "vanishing-updates", "severity": "warning", "message": "some"},
        {"rule": "format-not-accelerated", "severity": "error", "message": "slow"},
    ]
    records = paired("bf16_pure", [1.0, 1.2], [0.0, 0.0], doctor=doctor)
    d = decide(records, contract(candidates=("bf16_pure",)), higher_is_better=True)
    assert d.eligible == ("bf16_pure",)


def test_too_short_recommends_nothing() -> None:
    fast = [[0, 2.0], [tail_start(STEPS), 1.10], [STEPS, 1.0]]  # falling 10% in the last fifth
    records = [
        rec("fp32", 0, 1.0, eval_curve=fast),
        rec("fp32", 1, 1.0, eval_curve=fast),
        rec("amp_bf16", 0, 1.0, total=700),
        rec("amp_bf16", 1, 1.0, total=700),
        rec("amp_fp16", 0, 1.0, nonfinite_steps=3),
        rec("amp_fp16", 1, 1.0),
    ]
    c = contract(candidates=("amp_bf16", "amp_fp16"))
    d = decide(records, c, higher_is_better=True)
    assert "10.00%" in d.too_short and d.recommended is None and not d.success
    assert d.verdicts["amp_bf16"].status == "too_short"
    assert d.verdicts["amp_fp16"].status == "rejected"  # hard gates still reject
    # A larger tail limit accepts the same runs.
    loose = contract(candidates=("amp_bf16", "amp_fp16"), gates=Gates(max_tail_improvement=0.2))
    assert decide(records, loose, higher_is_better=True).recommended == "amp_bf16"


def test_a_run_of_the_whole_schedule_is_judged_without_converging() -> None:
    """Issue 31: a fine-tuning-like workload improves to the end of its schedule (fp32
    fell 2.48% over its last fifth at 400 steps and at 1200). A compare over the whole
    schedule the workload trains with measures that schedule's outcome; only a shorter
    one is too short, and it says which --steps decides."""
    still = [[0, 2.0], [tail_start(STEPS), 1.025], [STEPS, 1.0]]  # falling 2.5%
    records = [rec("fp32", k, 1.0, eval_curve=still) for k in range(2)]
    records += [rec("amp_bf16", k, 1.0, total=700) for k in range(2)]
    c = contract(candidates=("amp_bf16",))
    whole = decide(records, c, higher_is_better=True, stands_for=STEPS)
    assert not whole.too_short and whole.recommended == "amp_bf16"
    shorter = decide(records, c, higher_is_better=True, stands_for=3 * STEPS)
    assert "the runs covered 100 of the 300 steps" in shorter.too_short
    assert "--steps 300 (the whole schedule) decides" in shorter.too_short
    assert shorter.decide_with == {"steps": 300} and shorter.recommended is None
    assert shorter.verdicts["amp_bf16"].decide_with == {"steps": 300}
    from mixprec.experiment.report.wording import headline

    assert headline(shorter).endswith("To decide, rerun into the same --out with --steps 300.")
    # A longer compare than the workload's own schedule is whole too.
    assert not decide(records, c, higher_is_better=True, stands_for=STEPS // 2).too_short
    # Where the workload's own length is unknown (a folder of an older mixprec), the
    # pace of the last fifth still decides.
    unknown = decide(records, c, higher_is_better=True)
    assert unknown.too_short.endswith("train longer") and unknown.decide_with == {}


def test_an_inconclusive_verdict_says_what_would_decide() -> None:
    records = paired("amp_bf16", [1.0] * 5, [0.0, 0.008, 0.002, 0.006, 0.004])
    c = contract(candidates=("amp_bf16",), seeds=5)
    v = decide(records, c, higher_is_better=True).verdicts["amp_bf16"]
    assert v.status == "inconclusive"
    seeds = v.decide_with["max_seeds"]
    assert f"--max-seeds {seeds} would likely decide" in v.reason
    # The limit the data support is the interval's upper end, rounded up: under it the
    # same runs are eligible.
    from mixprec.experiment.report.wording import headline

    d = decide(records, c, higher_is_better=True)
    assert d.status == "stay" and d.decide_with == {"max_seeds": seeds}
    assert headline(d).endswith(
        f"To decide amp_bf16, rerun into the same --out with --max-seeds {seeds} (stored runs "
        "are reused)."
    )
    supported = v.decide_with["max_rel_loss_gap"]
    assert f"--max-rel-loss-gap {supported:g}" in v.reason
    looser = contract(candidates=("amp_bf16",), seeds=5, gates=Gates(max_rel_loss_gap=supported))
    assert decide(records, looser, higher_is_better=True).verdicts["amp_bf16"].status == (
        "eligible"
    )
    # A gap above the limit on average: more seeds would likely reject it.
    over = paired("amp_bf16", [1.0] * 5, [0.002, 0.010, 0.004, 0.008, 0.006])
    v = decide(over, c, higher_is_better=True).verdicts["amp_bf16"]
    assert "would likely reject it" in v.reason and "max_seeds" in v.decide_with


def test_speed_that_the_load_made_up_does_not_promote() -> None:
    """Issue 31: minutes apart, one run stayed on fp32 (bf16_master 1.82x slower) and
    another promoted bf16_master (1.24x). A candidate whose per-seed step-time ratios
    swing over its win is not promoted on speed alone; a steady one is."""
    base = [rec("fp32", k, 1.0, speed=10.0) for k in range(2)]
    # memory 0.5 of fp32's; step time 0.8x on one seed, 2.5x on the other: balanced
    # scores 0.5 x 1.65 = 0.825 on the mean, 1.25 at the slower seed.
    swung = [rec("bf16_master", k, 1.0, total=500, speed=v) for k, v in enumerate((12.5, 4.0))]
    d = decide([*base, *swung], contract(candidates=("bf16_master",)), higher_is_better=True)
    assert d.ranking[0].policy == "bf16_master"  # ahead on the mean ...
    assert d.recommended == "fp32" and d.status == "stay"  # ... but not promoted on it
    assert "not promoted on speed alone" in d.unsteady and "90% intervals" in d.unsteady
    from mixprec.experiment.report.wording import choice_lines

    assert choice_lines(d)[-2] == (
        "Chosen: stay on `fp32`; `bf16_master` leads at 0.825 only on step times that varied "
        "over seeds (below)."
    )
    # The same swing over 20 seeds pins the mean down: the interval of the mean ratio
    # narrows with seeds (a min-max range would only widen), and it is promoted.
    many = [rec("fp32", k, 1.0, speed=10.0) for k in range(20)]
    many += [rec("bf16_master", k, 1.0, total=500, speed=(12.5, 4.0)[k % 2]) for k in range(20)]
    d = decide(many, contract(candidates=("bf16_master",), seeds=20), higher_is_better=True)
    assert d.recommended == "bf16_master" and d.unsteady == ""
    steady = [rec("bf16_master", k, 1.0, total=500, speed=v) for k, v in enumerate((8.0, 7.9))]
    d = decide([*base, *steady], contract(candidates=("bf16_master",)), higher_is_better=True)
    assert d.recommended == "bf16_master" and d.unsteady == ""
    # Memory does not depend on the machine's load: the memory objective is never unsteady.
    d = decide(
        [*base, *swung],
        contract(candidates=("bf16_master",), objective="memory"),
        higher_is_better=True,
    )
    assert d.recommended == "bf16_master" and d.unsteady == ""


def test_missing_tail_evaluation_is_too_short() -> None:
    records = [rec("fp32", 0, 1.0, eval_curve=[]), rec("amp_bf16", 0, 1.0)]
    d = decide(records, contract(candidates=("amp_bf16",), seeds=1), higher_is_better=True)
    assert "no held-out evaluation" in d.too_short and d.recommended is None


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
        *paired("amp_bf16", [1.0, 1.0], [0.0, 0.0]),
        rec("amp_fp16", 0, 1.0, **kw),
        rec("amp_fp16", 1, 1.0),
    ]
    d = decide(records, contract(candidates=("amp_bf16", "amp_fp16")), higher_is_better=True)
    assert fragment in d.rejected["amp_fp16"]
    assert "amp_fp16" not in d.eligible


def test_metric_threshold_respects_direction() -> None:
    records = [
        rec("fp32", 0, 1.0, metric=0.9),
        rec("fp32", 1, 1.0, metric=0.9),
        rec("amp_bf16", 0, 1.0, metric=0.5),
        rec("amp_bf16", 1, 1.0, metric=0.5),
        rec("bf16_master", 0, 1.0, metric=0.95),
        rec("bf16_master", 1, 1.0, metric=0.95),
    ]
    c = contract(candidates=("amp_bf16", "bf16_master"), gates=Gates(metric_threshold=0.8))
    d = decide(records, c, higher_is_better=True)
    assert "misses >= 0.8" in d.rejected["amp_bf16"]
    assert d.eligible == ("bf16_master",)
    d2 = decide(records, c, higher_is_better=False)
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


def test_speed_breaks_memory_ties() -> None:
    records = [
        rec("fp32", 0, 1.0),
        rec("fp32", 1, 1.0),
        *[rec("amp_bf16", s, 1.0, total=700, speed=5.0) for s in (0, 1)],
        *[rec("bf16_master", s, 1.0, total=705, speed=9.0) for s in (0, 1)],
        *[rec("amp_fp16", s, 1.0, total=900, speed=20.0) for s in (0, 1)],
    ]
    d = decide(records, contract(objective="memory"), higher_is_better=True)
    assert d.recommended == "bf16_master"  # 705 is within 2% of 700, and faster


def test_contract_validation() -> None:
    with pytest.raises(ValueError, match="unknown precision policy 'nope'"):
        Contract(candidates=("nope",))
    with pytest.raises(ValueError, match="also listed as a candidate"):
        Contract(candidates=("fp32",))
    with pytest.raises(ValueError, match="unknown contract keys \\['stepz'\\]"):
        Contract.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match="unknown gate keys"):
        Contract.from_dict({"gates": {"max_gap": 1}})
    with pytest.raises(ValueError, match="replaced by 'confidence'"):
        Contract.from_dict({"gates": {"noise_multiplier": 2}})
    with pytest.raises(ValueError, match="max_seeds must be an int >= seeds"):
        Contract(seeds=3, max_seeds=2)
    with pytest.raises(ValueError, match="allow names \\['nope'\\], which are not update-path"):
        Contract(allow=("nope",))
    with pytest.raises(ValueError, match="confidence must be in"):
        Gates(confidence=1.0)
    with pytest.raises(ValueError, match="max_rel_loss_gap"):
        Gates(max_rel_loss_gap=math.nan)
    c = Contract.from_dict(
        {
            "candidates": "amp_bf16, bf16_master",
            "allow": ["vanishing-updates"],
            "max_seeds": 4,
            "gates": {"max_rel_loss_gap": 0.01, "confidence": 0.8},
        }
    )
    assert c.candidates == ("amp_bf16", "bf16_master") and c.gates.max_rel_loss_gap == 0.01
    assert c.allow == ("vanishing-updates",) and c.seed_limit == 4
    # The length checks keep their defaults whatever the gap limit (0.75%, 5%).
    assert c.gates.tail_limit == 0.0075 and c.gates.improvement_floor == 0.05
    assert Contract.from_dict(c.to_dict()) == c
    assert Contract(seeds=7).seed_limit == 7 and Contract().seed_limit == 5
    assert c.run_fingerprint("amp_bf16", 0) != c.run_fingerprint("amp_bf16", 1)
    assert c.run_fingerprint("amp_bf16", 0) == Contract.from_dict(c.to_dict()).run_fingerprint(
        "amp_bf16", 0
    )
    # Seeds, allow and gates do not change what a run computes: records stay reusable.
    assert c.run_fingerprint("amp_bf16", 0) == dataclasses.replace(
        c, max_seeds=9, allow=(), gates=Gates()
    ).run_fingerprint("amp_bf16", 0)


def test_capped_run_is_compared_at_its_own_step() -> None:
    def base_curve(at100: float, final: float) -> list[list[float]]:
        return [[0, 3.0], [80, at100 * 1.001], [100, at100], [400, final * 1.001], [500, final]]

    records = [
        rec("fp32", 0, 1.00, eval_curve=base_curve(1.50, 1.0), steps=500),
        rec("fp32", 1, 1.01, eval_curve=base_curve(1.52, 1.01), steps=500),
        rec("amp_bf16", 0, 1.0, steps=500),
        rec("amp_bf16", 1, 1.01, steps=500),
        rec("bf16_master", 0, 1.0, steps=500),
        rec("bf16_master", 1, 1.01, steps=500),
        # Stopped at step 100: 1.50 and 1.52 are the baseline's losses there, not 1.0.
        rec("amp_fp16", 0, 1.501, steps=100),
        rec("amp_fp16", 1, 1.521, steps=100),
    ]
    d = decide(records, contract(), higher_is_better=True)
    fp16 = d.summary("amp_fp16")
    assert fp16.steps == 100 and abs(fp16.rel_gap) < 1e-3
    assert "amp_fp16" in d.eligible
    worse = [*records[:6], rec("amp_fp16", 0, 1.60, steps=100), rec("amp_fp16", 1, 1.62, steps=100)]
    assert "amp_fp16" in decide(worse, contract(), higher_is_better=True).rejected
    # A capped run is judged too short by the baseline's pace at its own step.
    short = [
        rec(
            "fp32",
            s,
            final,
            eval_curve=[[0, 3.0], [80, 1.8], [100, 1.5], [400, final], [500, final]],
        )
        for s, final in ((0, 1.0), (1, 1.01))
    ]
    short = [dataclasses.replace(r, steps=500) for r in short] + records[2:]
    d = decide(short, contract(), higher_is_better=True)
    assert d.verdicts["amp_fp16"].status == "too_short" and "steps 80-100" in (
        d.verdicts["amp_fp16"].reason
    )
    assert not d.too_short and d.recommended is not None


def test_decision_json_has_per_policy_figures() -> None:
    records = paired("amp_bf16", [1.0, 1.1, 0.9], [0.001, 0.002, 0.0015])
    d = decide(records, contract(candidates=("amp_bf16",), seeds=3), higher_is_better=True)
    out = d.to_dict()["policies"]
    cand = out["amp_bf16"]
    assert cand["gaps"] == pytest.approx([0.001, 0.002, 0.0015])
    assert cand["gap_low"] < cand["gap_mean"] < cand["gap_high"]
    assert cand["paired_seeds"] == 3 and cand["seeds"] == [0, 1, 2]
    assert cand["verdict"]["status"] == "eligible" and cand["confidence"] == 0.9
    assert out["fp32"]["baseline_spread"] > 0 and "verdict" not in out["fp32"]


def test_step_caps_validation() -> None:
    with pytest.raises(ValueError, match="not a candidate"):
        Contract(candidates=("amp_bf16",), step_caps={"amp_fp16": 10})
    with pytest.raises(ValueError, match="must be an int >= 1"):
        Contract(candidates=("amp_fp16",), step_caps={"amp_fp16": 0})
    c = Contract.from_dict({"candidates": ["amp_fp16"], "step_caps": {"amp_fp16": 5}})
    assert Contract.from_dict(c.to_dict()) == c


def test_a_candidate_that_never_ran_is_not_run_not_rejected() -> None:
    """Found by review: an interrupted experiment's report said 'rejected (run): no runs'."""
    from mixprec.experiment.report import verdict_label

    records = paired("amp_bf16", [1.0, 1.01], [0.001, 0.001])
    d = decide(records, contract(candidates=("amp_bf16", "bf16_master")), higher_is_better=False)
    assert d.verdicts["bf16_master"].status == "not_run"
    assert "bf16_master" not in d.rejected and "bf16_master" in d.not_run
    assert verdict_label("bf16_master", d) == "not run"
    assert d.to_dict()["not_run"] == {"bf16_master": "not run yet: rerun compare to train it"}


def test_a_candidate_whose_baseline_runs_are_missing_is_not_run_not_rejected() -> None:
    """Found by the second review: with the baseline's record gone the candidates that
    ran were 'rejected (loss-gap)', as if their gap had been judged."""
    records = [rec("fp32", 1, 1.0), rec("amp_bf16", 0, 1.0)]
    d = decide(records, contract(candidates=("amp_bf16",)), higher_is_better=False)
    assert d.verdicts["amp_bf16"].status == "not_run"
    assert "amp_bf16" not in d.rejected


# ------------------------------------------------ objectives, budgets, target

#: The demo's shape (issue 18): fp32 fastest and largest; a bf16-storage policy half the
#: memory at half the speed; an fp32-storage AMP a little smaller and slower.
DEMO = {
    # policy: (bytes, steps/s, gap)
    "fp32": (8000, 120.0, 0.0),
    "amp_bf16": (7000, 80.0, 0.001),
    "bf16_master": (5000, 60.0, 0.002),
    "bf16_lean": (4000, 50.0, 0.001),
}
XEON = DeviceFacts(device_type="cpu", name="Intel Xeon", flags=("amx_bf16",), torch="2.13")


def demo(*, spread: float = 0.0, **kw: Any) -> list[RunRecord]:
    """Two seeds of `DEMO`; `spread` makes seed 1 that much slower for candidates."""
    out = []
    for seed in (0, 1):
        for policy, (total, speed, gap) in DEMO.items():
            slower = 1 - spread if seed and policy != "fp32" else 1
            fields = {"param_dtype": "fp32" if policy in ("fp32", "amp_bf16") else "bf16"}
            kw.setdefault("device", XEON)
            out.append(
                rec(
                    policy,
                    seed,
                    1.0 * (1 + gap),
                    total=total,
                    speed=speed * slower,
                    policy_fields=fields,
                    **kw,
                )
            )
    return out


def demo_contract(**kw: Any) -> Contract:
    return contract(candidates=("amp_bf16", "bf16_master", "bf16_lean"), **kw)


def test_speed_recommends_the_fastest_eligible_policy_the_baseline_when_none_is_faster() -> None:
    d = decide(demo(), demo_contract(objective="speed"), higher_is_better=False)
    assert d.recommended == "fp32" and d.status == "stay" and d.success
    assert [st.policy for st in d.ranking] == ["fp32", "amp_bf16", "bf16_master", "bf16_lean"]
    assert d.ranking[1].time_ratio == pytest.approx(120 / 80)
    faster = [dataclasses.replace(r, throughput={"steps_per_s": 150.0}) if r.policy == "bf16_lean"
              else r for r in demo()]  # fmt: skip
    d = decide(faster, demo_contract(objective="speed"), higher_is_better=False)
    assert d.recommended == "bf16_lean" and d.status == "recommended"


def test_memory_recommends_the_smallest() -> None:
    d = decide(demo(), demo_contract(objective="memory"), higher_is_better=False)
    assert d.recommended == "bf16_lean" and d.status == "recommended"
    assert d.ranking[0].memory_ratio == pytest.approx(0.5)


def test_balanced_takes_the_least_product_of_memory_and_step_time() -> None:
    d = decide(demo(), demo_contract(), higher_is_better=False)
    scores = {st.policy: st.score for st in d.ranking}
    assert scores == pytest.approx(
        {
            "fp32": 1.0,
            "amp_bf16": 7 / 8 * 120 / 80,  # 1.3125
            "bf16_master": 5 / 8 * 120 / 60,  # 1.25
            "bf16_lean": 4 / 8 * 120 / 50,  # 1.2
        }
    )
    # Every candidate costs more in time than it saves in memory: stay on fp32.
    assert d.recommended == "fp32" and d.status == "stay" and d.objective == "balanced"
    cheaper = [dataclasses.replace(r, throughput={"steps_per_s": 100.0})
               if r.policy == "bf16_lean" else r for r in demo()]  # fmt: skip
    d = decide(cheaper, demo_contract(), higher_is_better=False)
    assert d.recommended == "bf16_lean" and d.ranking[0].score == pytest.approx(0.6)


def test_balanced_ties_go_to_the_smaller_gap_and_a_full_tie_to_the_baseline() -> None:
    records = [
        *paired("amp_bf16", [1.0, 1.0], [0.003, 0.003], total=500),
        *[rec("bf16_master", s, 1.001, total=505) for s in (0, 1)],
    ]
    c = contract(candidates=("amp_bf16", "bf16_master"))
    d = decide(records, c, higher_is_better=False)
    assert [st.policy for st in d.ranking] == ["bf16_master", "amp_bf16", "fp32"]
    assert d.recommended == "bf16_master"  # 0.505 is within 2% of 0.5; gap 0.1% < 0.3%
    same = paired("amp_bf16", [1.0, 1.0], [0.0, 0.0])  # same memory, speed and loss
    d = decide(same, contract(candidates=("amp_bf16",)), higher_is_better=False)
    assert d.recommended == "fp32" and d.status == "stay"


def test_rank_puts_policies_without_figures_last() -> None:
    records = demo()
    records = [dataclasses.replace(r, throughput={}) if r.policy == "amp_bf16" else r
               for r in records]  # fmt: skip
    d = decide(records, demo_contract(objective="speed"), higher_is_better=False)
    assert d.ranking[-1].policy == "amp_bf16" and math.isnan(d.ranking[-1].score)
    assert d.recommended == "fp32"
    untimed = [dataclasses.replace(r, throughput={}) for r in demo()]
    d = decide(untimed, demo_contract(objective="speed"), higher_is_better=False)
    assert d.recommended is None and d.status == "none"
    assert "no step time measured for" in d.speed_note


def test_ratios_are_paired_per_seed_with_their_spread() -> None:
    d = decide(demo(spread=0.1), demo_contract(), higher_is_better=False)
    ratio = d.summary("bf16_lean").time_ratio
    assert ratio.values == pytest.approx((120 / 50, 120 / 45))
    assert (ratio.low, ratio.high) == pytest.approx((120 / 50, 120 / 45))
    assert ratio.mean == pytest.approx((120 / 50 + 120 / 45) / 2)
    assert d.summary("bf16_lean").memory_ratio.values == pytest.approx((0.5, 0.5))
    assert d.summary("fp32").time_ratio.values == (1.0,)
    stored = d.to_dict()
    assert stored["policies"]["bf16_lean"]["time_ratio"]["high"] == pytest.approx(120 / 45)
    assert stored["ranking"][0]["policy"] == "fp32" and stored["status"] == "stay"


def test_a_memory_budget_below_the_baseline_rejects_fp32_storage_and_the_baseline() -> None:
    d = decide(demo(), demo_contract(memory_budget=7500), higher_is_better=False)
    assert d.verdicts["amp_bf16"].status == "eligible"  # 7000 fits
    d = decide(demo(), demo_contract(memory_budget=6500), higher_is_better=False)
    v = d.verdicts["amp_bf16"]
    assert v.status == "rejected" and v.gate == "memory-budget"
    assert v.reason == (
        "measured 6.84 KiB, 500 B over memory_budget 6.35 KiB (fp32 storage: its parameters, "
        "gradients and moments are the baseline's)"
    )
    assert d.baseline_note == (
        "fp32 itself measured 7.81 KiB, 1.46 KiB over memory_budget 6.35 KiB: it cannot be "
        "the recommendation"
    )
    assert "fp32" not in [st.policy for st in d.ranking]
    assert d.recommended == "bf16_lean" and d.status == "recommended"  # 0.5 x 2.4 = 1.2 best
    d = decide(demo(), demo_contract(memory_budget=100), higher_is_better=False)
    assert d.eligible == () and d.recommended is None and d.status == "none"


def test_max_slowdown_rejects_with_the_figures_and_below_one_excludes_the_baseline() -> None:
    d = decide(demo(), demo_contract(objective="memory", max_slowdown=2.0), higher_is_better=False)
    v = d.verdicts["bf16_lean"]
    assert v.status == "rejected" and v.gate == "slowdown"
    assert v.reason.startswith("step time 2.40x fp32's (mean of ")
    assert v.reason.endswith(
        "paired seeds, 2.40-2.40; 50.0 vs 120.0 steps/s on those seeds) > max_slowdown 2"
    )
    assert d.recommended == "bf16_master"  # 2.0x: at the limit, within it
    d = decide(demo(), demo_contract(max_slowdown=0.9), higher_is_better=False)
    assert "asks for a policy faster than fp32" in d.baseline_note
    assert d.eligible == () and d.recommended is None


def test_a_budget_rejects_before_the_gap_needs_more_seeds() -> None:
    records = paired("amp_bf16", [1.0, 1.0], [-0.01, 0.02], total=2000)
    d = decide(records, contract(candidates=("amp_bf16",), memory_budget=1500),
               higher_is_better=False)  # fmt: skip
    assert d.verdicts["amp_bf16"].gate == "memory-budget" and not d.inconclusive


def test_runs_off_the_target_device_leave_the_decision_pending() -> None:
    c = demo_contract(objective="speed", target_device="cuda", max_slowdown=1.1)
    d = decide(demo(), c, higher_is_better=False)
    assert d.status == "pending_target" and d.recommended is None and not d.success
    assert d.pending.startswith("measured on cpu Intel Xeon, not on the target cuda")
    assert d.speed_note == "step times measured on cpu Intel Xeon do not transfer to cuda"
    # The quality evidence is kept; the slowdown limit is not judged on CPU timings.
    assert d.eligible == ("amp_bf16", "bf16_master", "bf16_lean")
    assert [st.policy for st in d.ranking] == ["bf16_lean", "bf16_master", "amp_bf16", "fp32"]
    assert d.to_dict()["status"] == "pending_target" and d.to_dict()["target_device"] == "cuda"
    # Every objective waits, and so does a target the runs cannot be shown to match.
    for objective in ("memory", "balanced"):
        c = demo_contract(objective=objective, target_device="H100")
        assert decide(demo(), c, higher_is_better=False).status == "pending_target"
    bare = demo(device=None)
    d = decide(bare, demo_contract(target_device="cpu"), higher_is_better=False)
    assert d.status == "pending_target" and "hardware not recorded" in d.pending
    # Measured on the target: decided as usual.
    for target in ("cpu", "xeon"):
        d = decide(demo(), demo_contract(target_device=target), higher_is_better=False)
        assert d.status == "stay" and not d.pending


def test_step_times_from_several_machines_rank_nothing_but_memory() -> None:
    other = DeviceFacts(device_type="cpu", name="AMD EPYC", torch="2.13")
    mixed = [dataclasses.replace(r, device=other) if r.seed == 1 else r for r in demo()]
    d = decide(mixed, demo_contract(objective="speed"), higher_is_better=False)
    assert d.status == "none" and d.recommended is None
    assert "2 different setups" in d.speed_note and len(d.hardware) == 2
    d = decide(mixed, demo_contract(objective="memory"), higher_is_better=False)
    assert d.recommended == "bf16_lean" and not d.speed_note.startswith("no ")


def test_a_slowdown_reason_pairs_its_throughputs_and_shows_the_excess() -> None:
    base = [rec("fp32", k, 1.0, speed=v) for k, v in enumerate([100.0, 100.0, 40.0])]
    cand = [rec("amp_bf16", k, 1.0, speed=v) for k, v in enumerate([80.0, 82.0])]
    ratio = (100 / 80 + 100 / 82) / 2  # 1.2348: seeds 0 and 1, the ones both ran
    c = contract(candidates=("amp_bf16",), max_slowdown=1.23)
    v = decide(base + cand, c, higher_is_better=False).verdicts["amp_bf16"]
    assert v.gate == "slowdown"
    assert v.reason == (
        f"step time {ratio:.4f}x fp32's (mean of 2 paired seeds, 1.22-1.25; 81.0 vs 100.0 "
        "steps/s on those seeds) > max_slowdown 1.23"
    )


def test_a_decision_with_runs_missing_recommends_nothing() -> None:
    """An interrupted experiment re-judged by `mixprec report`: seed 1 of amp_bf16 never
    ran, so the choice could still change."""
    records = paired("amp_bf16", [1.0, 1.01, 0.99], [0.0, 0.0005, 0.0], total=500)
    c = contract(candidates=("amp_bf16",), seeds=3)
    assert decide(records, c, higher_is_better=False).recommended == "amp_bf16"
    partial = [r for r in records if not (r.policy == "amp_bf16" and r.seed == 1)]
    d = decide(partial, c, higher_is_better=False)
    assert d.recommended is None and d.status == "none" and not d.success
    assert d.incomplete == (
        "1 run(s) of the contract's seeds have no record (amp_bf16 seed 1): rerun compare "
        "to train them"
    )
    assert d.to_dict()["incomplete"] == d.incomplete


def test_a_candidate_alone_without_the_objective_figure_is_not_recommended() -> None:
    """Staying on the baseline needs no figure; promoting the only eligible candidate
    (the baseline over the memory budget) still needs the objective's."""
    records = [rec("fp32", k, 1.0, total=1000) for k in range(2)]
    records += [rec("amp_bf16", k, 1.0, total=500, throughput={}) for k in range(2)]
    c = contract(candidates=("amp_bf16",), objective="speed", memory_budget=800)
    d = decide(records, c, higher_is_better=True)
    assert d.eligible == ("amp_bf16",) and d.baseline_note
    assert d.recommended is None and d.status == "none" and "no step time" in d.speed_note
