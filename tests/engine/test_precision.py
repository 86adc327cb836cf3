"""`Precision` end to end: every preset trains; the plan, `describe` and `summary`."""

from __future__ import annotations

import json
import math

import pytest

from mixprec import Precision
from mixprec.policy import PRESET_NAMES

from .helpers import make_model, train

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_trains(name: str) -> None:
    prec = Precision(name)
    losses = train(prec, steps=20)
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, (name, losses)
    assert prec.stats.steps == 20 and prec.stats.skipped_steps == 0


def test_describe_and_summary_name_the_plan_and_the_island_modules() -> None:
    prec = Precision("bf16_master", device="cpu")
    before = prec.describe()
    assert before["plan"] == prec.plan.to_dict() and before["fp32_islands"] is None
    assert prec.fp32_islands is None
    assert "not known until prepare" in prec.summary()
    prec.prepare(make_model())  # a LayerNorm at index 1
    desc = prec.describe()
    assert desc["fp32_islands"] == ["1"] and prec.fp32_islands == ("1",)
    assert desc["compute_supported"] and desc["policy"] == prec.policy.to_dict()
    assert json.loads(json.dumps(desc)) == desc
    text = prec.summary()
    lines = text.splitlines()
    assert lines[0].startswith("policy 'bf16_master': compute bf16")
    assert lines[1].startswith("device: cpu")
    assert "fp32 islands: *Norm" in text and "master: exact" in text
    assert lines[-1] == "fp32 island modules: 1"
    fp32 = Precision("amp_bf16", device="cpu")
    fp32.prepare(make_model())
    assert fp32.fp32_islands == () and fp32.summary().endswith("fp32 island modules: none")
