"""The FP8 trace in run records: built from the probe's samples, bounded, validated,
round-tripped through JSON, and stored by a real fp8 run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from mixprec.doctor.runtime.fp8_measure import Fp8CastRecord, Fp8CastStats, Fp8TensorSample
from mixprec.experiment import Contract
from mixprec.experiment.fp8_trace import Fp8TensorTrace, Fp8Trace, build_fp8_trace
from mixprec.experiment.records import (
    RunRecord,
    load_records,
    record_path,
    strict_json,
    write_json_atomic,
)

from .test_decision import rec


def stats(
    *, elements: int = 100, saturated: int = 0, underflow: int = 0, amax: float = 1.0
) -> Fp8CastStats:
    return Fp8CastStats(
        elements=elements,
        zeros=0,
        saturated=saturated,
        underflow=underflow,
        amax=amax,
        scale_min=448.0 / amax,
        scale_max=448.0 / amax,
    )


def sample(
    step: int,
    layer: str,
    role: str = "input",
    *,
    delayed: Fp8CastStats | None = None,
    **kw: Any,
) -> Fp8TensorSample:
    cast = Fp8CastRecord(gemms=("output",), granularity="tensorwise", stats=stats(**kw))
    return Fp8TensorSample(
        step=step,
        layer=layer,
        role=role,
        format="fp8_e5m2" if role == "grad_output" else "fp8_e4m3",
        recipe="tensorwise",
        casts=(cast,),
        delayed=delayed,
        delayed_scale=None if delayed is None else 448.0,
        history=(1.0,),
        samples=1,
    )


def test_the_worst_tensors_are_kept_in_full_and_the_rest_aggregated_per_role() -> None:
    samples = []
    for step in (0, 10, 20):
        for i in range(5):
            # layer i flushes i% of its input; l4 worst; grad of l0 clips 3% at step 10
            samples.append(sample(step, f"l{i}", underflow=i, amax=1.0 + i + step))
            samples.append(
                sample(
                    step,
                    f"l{i}",
                    "grad_output",
                    saturated=3 if (i, step) == (0, 10) else 0,
                    amax=0.5,
                    delayed=None if step == 0 else stats(saturated=i),
                )
            )
    trace = build_fp8_trace(samples, max_tensors=3)
    assert trace is not None and (trace.layers, trace.samples) == (5, 3)
    assert [t.label for t in trace.worst] == ["l4 (input)", "l3 (input)", "l0 (grad_output)"]
    l0 = trace.worst[2]
    assert l0.steps == (0, 10, 20) and l0.saturated == (0.0, 0.03, 0.0)
    assert math.isnan(l0.delayed_saturated[0]) and l0.delayed_saturated[1:] == (0.0, 0.0)
    assert trace.worst[0].scale == (448.0 / 5.0, 448.0 / 15.0, 448.0 / 25.0)
    # the rest: inputs of l0-l2 (the largest amax and fraction, the smallest scale)
    # and gradients of l1-l4 (the what-if of l4 is the largest)
    inputs, grads = trace.tensors[3:]
    assert (inputs.layer, inputs.role, inputs.tensors) == ("3 other layers", "input", 3)
    assert inputs.underflow == (0.02, 0.02, 0.02) and inputs.amax == (3.0, 13.0, 23.0)
    assert inputs.scale == (448.0 / 3.0, 448.0 / 13.0, 448.0 / 23.0)
    assert (grads.layer, grads.tensors, grads.format) == ("4 other layers", 4, "fp8_e5m2")
    assert math.isnan(grads.delayed_saturated[0]) and grads.delayed_saturated[1:] == (0.04, 0.04)
    assert build_fp8_trace([]) is None


def test_a_long_run_is_bucketed_without_losing_a_peak() -> None:
    samples = [sample(s, "l0", underflow=7 if s == 333 else 1) for s in range(1000)]
    trace = build_fp8_trace(samples, max_points=200)
    assert trace is not None and trace.samples == 1000
    (t,) = trace.tensors
    assert len(t.steps) == 200 and t.steps[-1] == 999 and t.steps[0] == 4
    assert t.peak_underflow == 0.07 and sorted(t.underflow)[-2] == 0.01
    with pytest.raises(ValueError, match="max_points=0 must be >= 1"):
        build_fp8_trace(samples, max_points=0)


def test_a_role_with_one_tensor_left_keeps_it_as_is() -> None:
    samples = [sample(0, "a", underflow=5), sample(0, "b"), sample(0, "b", "weight")]
    trace = build_fp8_trace(samples, max_tensors=1)
    assert trace is not None
    assert [(t.label, t.tensors) for t in trace.tensors] == [
        ("a (input)", 1),
        ("b (weight)", 1),
        ("b (input)", 1),
    ]


def _trace() -> Fp8Trace:
    trace = build_fp8_trace(
        [sample(s, "l0", delayed=None if s == 0 else stats(saturated=2)) for s in (0, 5)]
    )
    assert trace is not None
    return trace


def test_a_record_round_trips_its_trace_through_strict_json(tmp_path: Path) -> None:
    r = rec("fp8_tensorwise", 0, 1.0, fp8_trace=_trace())
    write_json_atomic(record_path(tmp_path, r.policy, 0), r.to_dict())
    stored = json.loads(record_path(tmp_path, r.policy, 0).read_text())
    assert stored["fp8_trace"]["tensors"][0]["delayed_saturated"] == [None, 0.02]  # NaN: null
    (back,), skipped, _ = load_records(tmp_path)
    assert not skipped
    assert back.fp8_trace is not None
    assert strict_json(back.fp8_trace.to_dict()) == strict_json(_trace().to_dict())
    assert math.isnan(back.fp8_trace.tensors[0].delayed_saturated[0])
    assert back.fp8_trace.tensors[0].delayed_saturated[1] == 0.02


def test_a_record_without_a_trace_still_loads() -> None:
    data = rec("fp8_tensorwise", 0, 1.0).to_dict()
    assert data["fp8_trace"] is None
    del data["fp8_trace"]  # a record written before mixprec stored traces
    assert RunRecord.from_dict(data).fp8_trace is None


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update(layers=-1), r"'fp8_trace.layers' must be an int >= 0"),
        (lambda t: t.update(tensors={}), r"'fp8_trace.tensors' must be a list"),
        (
            lambda t: t["tensors"][0].update(layer=3),
            r"'fp8_trace.tensors\[0\].layer' must be a string",
        ),
        (
            lambda t: t["tensors"][0].update(steps=[0, -5]),
            r"'fp8_trace.tensors\[0\].steps' must be a list of steps",
        ),
        (
            lambda t: t["tensors"][0].update(amax=[1.0, "big"]),
            r"'fp8_trace.tensors\[0\].amax' must hold numbers or null",
        ),
        (
            lambda t: t["tensors"][0].update(scale=[1.0]),
            r"'fp8_trace.tensors\[0\]': .*scale has 1 values for 2 steps",
        ),
        (
            lambda t: t["tensors"][0].update(tensors=0),
            r"'fp8_trace.tensors\[0\].tensors' must be an int >= 1",
        ),
        # impossible values, not only wrong types (an edited record)
        (
            lambda t: t["tensors"][0].update(saturated=[0.0, 7.0]),
            r"saturated holds 7.0, not a fraction in \[0, 1\]",
        ),
        (lambda t: t["tensors"][0].update(amax=[-2.0, 1.0]), r"amax holds -2.0, not >= 0"),
        (lambda t: t["tensors"][0].update(format="fp4"), r"format 'fp4' is not an fp8 format"),
        (lambda t: t["tensors"][0].update(role="bias"), r"role must be one of weight, input"),
        (
            lambda t: t.update(tensors=t["tensors"] * 51),
            r"holds 51 tensors, more than a trace keeps \(11\)",
        ),
    ],
)
def test_a_bad_trace_is_refused_naming_the_field(edit: Any, message: str) -> None:
    data = strict_json(rec("fp8_tensorwise", 0, 1.0, fp8_trace=_trace()).to_dict())
    edit(data["fp8_trace"])
    with pytest.raises(ValueError, match=message):
        RunRecord.from_dict(data)
    with pytest.raises(ValueError, match="'fp8_trace' must be an object or null"):
        RunRecord.from_dict({**data, "fp8_trace": [1]})


def test_series_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="underflow has 0 values for 1 steps"):
        Fp8TensorTrace(
            layer="a",
            role="input",
            format="fp8_e4m3",
            steps=(0,),
            amax=(1.0,),
            scale=(1.0,),
            saturated=(0.0,),
            underflow=(),
            delayed_saturated=(math.nan,),
        )


def test_a_real_fp8_run_stores_the_probes_samples(tmp_path: Path) -> None:
    pytest.importorskip("torchao.float8")
    from mixprec.experiment import run_experiment

    contract = Contract(
        workload="shakespeare",
        size="tiny",
        baseline="fp32",
        candidates=("fp8_rowwise",),
        seeds=1,
        max_seeds=1,
        train={"steps": 6},
        eval_every=3,
        probe_every=2,
    )
    _, records = run_experiment(contract, tmp_path, stream=None)
    by = {r.policy: r for r in records}
    assert by["fp32"].fp8_trace is None
    fp8 = by["fp8_rowwise"]
    assert fp8.ok, fp8.error
    trace = fp8.fp8_trace
    assert trace is not None
    converted = fp8.effective["fp8"]["converted"]
    assert trace.layers == len(converted) and trace.samples == 3
    labels = {t.label for t in trace.worst}
    # tiny: 3 layers x (weight, input, grad_output) = 9 tensors: the 8 worst, and the
    # one left over (alone in its role) as it is
    assert len(trace.tensors) == 9 and len(labels) == 9
    for t in trace.tensors:
        assert t.steps == (0, 2, 4)
        assert all(a > 0 for a in t.amax) and all(0 <= u <= 1 for u in t.underflow)
        # rowwise scales are powers of two, from the amax: scale x amax <= 448
        assert all(
            math.log2(s).is_integer() and s * a <= 448 for s, a in zip(t.scale, t.amax, strict=True)
        )
    assert fp8.probes["fp8_underflow_fraction_max"] == max(t.peak_underflow for t in trace.tensors)
    (stored,) = (r for r in load_records(tmp_path)[0] if r.policy == "fp8_rowwise")
    assert stored.fp8_trace is not None
    assert strict_json(stored.fp8_trace.to_dict()) == strict_json(trace.to_dict())


def test_a_record_with_a_bad_trace_keeps_its_run_and_says_why(tmp_path: Path) -> None:
    """Nothing is judged on the trace: a bad one is left out, the losses still count."""
    r = rec("fp8_tensorwise", 0, 1.25, fp8_trace=_trace())
    data = strict_json(r.to_dict())
    data["fp8_trace"]["tensors"][0]["amax"] = [1.0]  # 1 value for 2 steps
    record_path(tmp_path, r.policy, 0).parent.mkdir(parents=True, exist_ok=True)
    record_path(tmp_path, r.policy, 0).write_text(json.dumps(data))
    (back,), skipped, notes = load_records(tmp_path)
    assert not skipped and back.heldout_loss == 1.25 and back.fp8_trace is None
    (note,) = notes
    assert "its fp8 trace was left out (field 'fp8_trace.tensors[0]'" in note
    assert note.endswith("the run is kept")
