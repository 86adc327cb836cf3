from __future__ import annotations

import json

import pytest

from mixprec.doctor import (
    INPUT_RULES,
    RULES,
    RUNTIME_RULES,
    STATIC_RULES,
    Finding,
    has_errors,
    sort_findings,
)

# Rule ids are contract: scripts filter on them. Changing this pin is a decision.
PINNED_STATIC = (
    "optimizer-state-16bit",
    "fp16-without-loss-scaling",
    "loss-scaling-unneeded",
    "reduce-dtype-16bit",
    "fsdp-without-mixed-precision",
    "master-without-16bit-params",
    "format-not-accelerated",
    "norm-in-16bit",
    "fp8-without-scaling",
)
PINNED_RUNTIME = (
    "clip-before-unscale",
    "loss-scale-collapse",
    "gradient-underflow",
    "vanishing-updates",
    "nonfinite-source",
    "grad-accum-16bit",
    "fp8-saturation",
    "fp8-underflow",
)


def _finding(**overrides: object) -> Finding:
    values: dict[str, object] = {
        "rule": "reduce-dtype-16bit",
        "severity": "warning",
        "where": "run.yaml:3 distributed.reduce_dtype",
        "message": "m",
        "evidence": {"reduce_dtype": "bf16"},
        "fix": "f",
    }
    values.update(overrides)
    return Finding(**values)  # type: ignore[arg-type]


def test_rule_ids_are_pinned() -> None:
    assert STATIC_RULES == PINNED_STATIC
    assert RUNTIME_RULES == PINNED_RUNTIME
    assert INPUT_RULES == ("config-unreadable",)
    assert set(RULES) == set(PINNED_STATIC) | set(PINNED_RUNTIME) | set(INPUT_RULES)


def test_finding_validates_rule_severity_and_evidence() -> None:
    with pytest.raises(ValueError, match="unknown rule 'no-such-rule'"):
        _finding(rule="no-such-rule")
    with pytest.raises(ValueError, match=r"unknown severity 'fatal'.*error, warning, info"):
        _finding(severity="fatal")
    with pytest.raises(TypeError, match="not JSON-ready"):
        _finding(evidence={"dtype": object()})


def test_finding_round_trips_through_json() -> None:
    f = _finding(evidence={"fraction": 0.25, "steps": [1, 2]})
    again = Finding.from_dict(json.loads(json.dumps(f.to_dict())))
    assert again == f


def test_sort_puts_errors_first_and_has_errors() -> None:
    info = _finding(rule="loss-scaling-unneeded", severity="info")
    warn = _finding()
    err = _finding(rule="optimizer-state-16bit", severity="error")
    assert sort_findings([info, warn, err]) == [err, warn, info]
    assert has_errors([info, err]) and not has_errors([info, warn])
