from __future__ import annotations

import dataclasses
import inspect

import pytest

from mixprec.doctor import Probe, ProbeThresholds


def test_probe_keywords_are_the_thresholds_with_the_same_defaults() -> None:
    params = inspect.signature(Probe).parameters
    for field in dataclasses.fields(ProbeThresholds):
        assert params[field.name].default == field.default, field.name
    probe = Probe(zero_threshold=0.2, window=7)
    assert probe.thresholds == ProbeThresholds(zero_threshold=0.2, window=7)


def test_thresholds_are_frozen_and_documented() -> None:
    t = ProbeThresholds()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.window = 3  # type: ignore[misc]
    doc = inspect.getdoc(ProbeThresholds) or ""
    for field in dataclasses.fields(ProbeThresholds):
        assert f"{field.name}:" in doc, field.name


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"underflow_threshold": 0.0}, ValueError, r"underflow_threshold must be in \(0, 1\]"),
        ({"vanishing_threshold": "x"}, TypeError, "vanishing_threshold must be a number"),
        ({"window": 0}, ValueError, "window must be an integer >= 1, got 0"),
        ({"falling_run": True}, ValueError, "falling_run must be an integer >= 1"),
        ({"min_skips": -1}, ValueError, "min_skips must be an integer >= 0"),
        ({"hunt_steps": 1.5}, ValueError, "hunt_steps must be an integer >= 1"),
    ],
)
def test_thresholds_are_validated(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ProbeThresholds(**kwargs)  # type: ignore[arg-type]
