"""`PrecisionPlan`: the policy read once, equal for equal policies, executed as resolved."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

import mixprec
from mixprec import LossScaling, Policy, Precision
from mixprec.engine import PrecisionPlan, resolve_plan
from mixprec.formats import master_spec, moment_spec
from mixprec.islands import IslandRule
from mixprec.policy import PRESET_NAMES

from .helpers import train

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


def test_the_plan_holds_every_decision_of_the_policy() -> None:
    plan = resolve_plan(mixprec.preset("bf16_master"))
    assert plan.policy_name == "bf16_master"
    assert plan.autocast_dtype == torch.bfloat16 and plan.autocast_enabled
    assert plan.storage_dtype == torch.bfloat16
    assert plan.islands == IslandRule(mixprec.preset("bf16_master").fp32_modules, active=True)
    assert plan.master == master_spec("exact") and plan.moments == moment_spec("fp32")
    assert plan.loss_scaling is None and not plan.scales_loss and not plan.dynamic_scaling
    assert plan.reduce_dtype == torch.float32
    amp = resolve_plan(mixprec.preset("amp_fp16"))
    assert amp.loss_scaling == LossScaling() and amp.scales_loss and amp.dynamic_scaling
    assert not amp.islands.active  # fp32 storage: autocast's op lists decide
    static = resolve_plan(
        Policy(compute_dtype=torch.float16, loss_scaling=LossScaling.static(128.0))
    )
    assert static.scales_loss and not static.dynamic_scaling
    fp32 = resolve_plan(mixprec.preset("fp32"))
    assert fp32.autocast_dtype is None and not fp32.autocast_enabled
    pure = resolve_plan(mixprec.preset("bf16_pure"))
    assert pure.risks == mixprec.preset("bf16_pure").risks() and pure.risks


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_equal_policies_give_equal_frozen_plans(name: str) -> None:
    a, b = Precision(name), Precision(mixprec.preset(name))
    assert isinstance(a.plan, PrecisionPlan)
    assert a.plan == b.plan == resolve_plan(a.policy)
    assert hash(a.plan) == hash(b.plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.plan.storage_dtype = torch.float16  # type: ignore[misc]
    data = a.plan.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["master"] == a.policy.master and data["moments"] == a.policy.moments
    text = a.plan.describe()
    assert "autocast:" in text and f"master: {a.policy.master}" in text


def test_different_policies_give_different_plans() -> None:
    assert Precision("bf16_master").plan != Precision("bf16_lean").plan
    assert Precision("amp_fp16").plan != Precision("amp_bf16").plan


def test_the_plan_is_resolved_once_per_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("mixprec.engine.precision")
    calls: list[str] = []

    def counting(policy: Policy) -> PrecisionPlan:
        calls.append(policy.name)
        return resolve_plan(policy)

    monkeypatch.setattr(module, "resolve_plan", counting)
    prec = Precision("amp_fp16")
    train(prec, steps=5)
    prec.describe()
    prec.state_dict()
    assert calls == ["amp_fp16"]


class _Untouchable:
    """Stands in for the policy: any read of it fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the engine read policy.{name} after building its plan")


@pytest.mark.parametrize("name", ["amp_fp16", "bf16_master", "bf16_pure", "fp32"])
def test_a_training_loop_reads_the_plan_not_the_policy(name: str) -> None:
    prec = Precision(name)
    prec.policy = _Untouchable()  # type: ignore[assignment]
    losses = train(prec, steps=4)
    assert len(losses) == 4 and prec.stats.applied_steps == 4


def test_a_run_changes_nothing_global() -> None:
    watched = {
        "Module.__call__": torch.nn.Module.__call__,
        "LayerNorm.forward": torch.nn.LayerNorm.forward,
        "Linear.forward": torch.nn.Linear.forward,
        "layer_norm": torch.nn.functional.layer_norm,
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "GradScaler.step": torch.amp.GradScaler.step,
        "autocast": torch.autocast,
    }
    for name in ["amp_fp16", "bf16_master"]:
        train(Precision(name), steps=3)
    now = {
        "Module.__call__": torch.nn.Module.__call__,
        "LayerNorm.forward": torch.nn.LayerNorm.forward,
        "Linear.forward": torch.nn.Linear.forward,
        "layer_norm": torch.nn.functional.layer_norm,
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "GradScaler.step": torch.amp.GradScaler.step,
        "autocast": torch.autocast,
    }
    assert now == watched
    assert not torch.is_autocast_enabled("cpu")


def test_reduce_and_output_dtypes_are_planned_and_an_unapplied_output_cast_refused() -> None:
    pol = mixprec.preset("amp_bf16").replace(reduce_dtype=torch.bfloat16)
    assert resolve_plan(pol).reduce_dtype == torch.bfloat16  # applied by the wrappers
    # One process reduces nothing: a reduce dtype is moot there, an output cast is not.
    mixprec.Precision(pol).prepare(torch.nn.Linear(2, 2))
    out = mixprec.preset("amp_bf16").replace(output_dtype=torch.bfloat16)
    assert resolve_plan(out).output_dtype == torch.bfloat16
    with pytest.raises(mixprec.PrecisionError, match=r"output.*only an FSDP2 root.*shard"):
        mixprec.Precision(out).prepare(torch.nn.Linear(2, 2))
