"""The optimizer of a contract or recipe: its arguments, its checks, the settings it
trains with, the contract key, and the optimizer a run builds."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import mixprec
from mixprec.experiment import Contract
from mixprec.experiment.optimizer import (
    LION_LR_DIVISOR,
    build_optimizer,
    parse_optimizer_args,
    resolve_train,
)
from mixprec.experiment.plan import settings_dict, settings_for
from mixprec.experiment.recipe import Recipe
from mixprec.workloads import load_workload
from mixprec.workloads.settings import lr_at

V3_CONTRACT = Path(__file__).parent / "fixtures" / "v3_overrides" / "contract.json"


# ------------------------------------------------------------------ arguments


def test_arguments_are_read_as_data() -> None:
    args = parse_optimizer_args(
        "momentum=0.9, nesterov=true,dampening=0,lr=3e-4,betas=(0.9,0.95),fused=none,b=[1,2e-1]"
    )
    assert args == {
        "momentum": 0.9,
        "nesterov": True,
        "dampening": 0,
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "fused": None,
        "b": (1, 0.2),
    }
    # A contract file's mapping: YAML 1.1 leaves 3e-4 a string.
    assert parse_optimizer_args({"lr": "3e-4", "betas": [0.9, 0.95]}) == {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
    }
    # Nothing is evaluated: text stays text (refused once the key is known).
    assert parse_optimizer_args("eps=__import__('os')") == {"eps": "__import__('os')"}


@pytest.mark.parametrize(
    ("name", "args", "says"),
    [
        ("rmsprop", "", "optimizer 'rmsprop' is not one of adamw, adam, sgd, lion"),
        ("sgd", "momentum=0.9", "optimizer sgd needs a learning rate"),
        ("sgd", "lr=0.1,betas=(0.9,0.9)", "optimizer_args 'betas' is not an argument of sgd"),
        ("lion", "momentum=0.9", "optimizer_args 'momentum' is not an argument of lion"),
        ("adamw", "master=exact", "optimizer_args 'master' is not an optimizer setting here"),
        ("adamw", "moments=int8", "the policy decides the moment format"),
        ("adamw", "eps=abc", "optimizer_args eps='abc' is not a number"),
        ("adamw", "eps=1e-6,eps=1e-7", "optimizer_args gives 'eps' twice"),
        ("adamw", "eps", "optimizer_args item 'eps' is not key=value"),
        ("adamw", "lr=inf", "optimizer_args lr='inf' is not a number"),
        ("adamw", "lr=-1", "lr must be a finite number > 0"),
        ("adamw", "eps=-1", "optimizer adamw refuses its arguments (eps=-1): Invalid epsilon"),
        ("sgd", "lr=0.1,nesterov=true", "Nesterov momentum requires a momentum"),
        ("adamw", "capturable=true", "capturable=True is not supported"),
    ],
)
def test_bad_optimizers_are_refused_naming_the_value(name: str, args: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        Contract(workload="digits", optimizer=name, optimizer_args=args)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_betas_set_for_an_optimizer_without_them_is_refused() -> None:
    with pytest.raises(
        ValueError, match=re.escape("betas (0.9,0.95) is set, but sgd takes no betas")
    ):
        Contract.from_dict({"optimizer": "sgd", "lr": 0.1, "betas": [0.9, 0.95]})


def test_a_training_setting_given_twice_must_agree() -> None:
    with pytest.raises(
        ValueError, match=re.escape("lr is given twice, 0.1 as a training setting and 0.2")
    ):
        Contract(workload="digits", optimizer="sgd", optimizer_args="lr=0.2", train={"lr": 0.1})
    same = Contract(workload="digits", optimizer="sgd", optimizer_args="lr=0.1", train={"lr": 0.1})
    assert same.train["lr"] == 0.1


# ------------------------------------------------------------ the contract key


def test_the_default_is_adamw_and_keeps_the_hashes_of_before() -> None:
    """A contract without the key, and one naming adamw, are today's contract: the same
    digest and run fingerprints as the version-3 fixture (its runs are reused)."""
    stored = json.loads(V3_CONTRACT.read_text(encoding="utf-8"))["contract"]
    plain = Contract.from_dict(stored)
    named = Contract.from_dict({**stored, "optimizer": "ADAMW", "optimizer_args": ""})
    assert named.to_dict() == plain.to_dict() == stored
    assert named.digest() == plain.digest()
    assert named.run_fingerprint("fp32", 0, 7) == plain.run_fingerprint("fp32", 0, 7)


def test_each_optimizer_is_its_own_contract() -> None:
    base = Contract(workload="digits", train={"lr": 0.05})
    others = [
        Contract(workload="digits", optimizer="sgd", train={"lr": 0.05}),
        Contract(workload="digits", optimizer="sgd", optimizer_args="momentum=0.9,lr=0.05"),
        Contract(workload="digits", optimizer="lion", train={"lr": 0.05}),
        Contract(workload="digits", optimizer="adam", train={"lr": 0.05}),
        Contract(workload="digits", optimizer_args="amsgrad=true", train={"lr": 0.05}),
    ]
    prints = {c.run_fingerprint("fp32", 0) for c in [base, *others]}
    assert len(prints) == 1 + len(others)
    # The learning rate is a training setting however it is given: the same contract.
    given = Contract(workload="digits", optimizer="sgd", optimizer_args="lr=0.05,momentum=0.9")
    assert given.train == {"lr": 0.05} and given.optimizer_args == {"momentum": 0.9}
    assert given.to_dict() == others[1].to_dict()
    assert given.to_dict()["optimizer_args"] == {"momentum": 0.9}
    assert Contract.from_dict(given.to_dict()) == given


# --------------------------------------------------------- settings it trains with


def test_the_workload_settings_carry_over_where_they_mean_the_same() -> None:
    digits = load_workload("digits", size="tiny")
    d = digits.defaults
    assert resolve_train(d, {"steps": 9}, "adamw") == d.with_overrides({"steps": 9})
    adam = resolve_train(d, {}, "adam")
    assert (adam.lr, adam.betas, adam.weight_decay) == (d.lr, d.betas, 0.0)
    lion = resolve_train(d, {}, "lion")
    assert lion.lr == d.lr / LION_LR_DIVISOR and lion.min_lr == d.min_lr / LION_LR_DIVISOR
    assert lion.weight_decay == d.weight_decay * LION_LR_DIVISOR and lion.betas == (0.9, 0.99)
    sgd = resolve_train(d, {"lr": 0.05}, "sgd")
    # The schedule keeps its shape: min_lr keeps the workload's ratio to lr.
    assert sgd.lr == 0.05 and sgd.min_lr == pytest.approx(0.05 * d.min_lr / d.lr)
    assert sgd.weight_decay == 0.0
    given = resolve_train(d, {"lr": 0.05, "min_lr": 0.01, "weight_decay": 0.1}, "sgd")
    assert (given.min_lr, given.weight_decay) == (0.01, 0.1)
    c = Contract(workload="digits", size="tiny", optimizer="sgd", optimizer_args="lr=0.05")
    stored = settings_dict(settings_for(c, digits))
    assert "betas" not in stored and stored["optimizer"] == "sgd" and stored["lr"] == 0.05


def _prepared(policy: str) -> tuple[mixprec.Precision, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    prec = mixprec.Precision(policy)
    prec.prepare(model)
    return prec, model


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_adamw_is_built_as_precision_optimizer_builds_it() -> None:
    train = load_workload("digits", size="tiny").defaults
    prec, model = _prepared("bf16_master")
    ours = build_optimizer(prec, model, "adamw", {}, train, seed=3)
    prec2, model2 = _prepared("bf16_master")
    lr = lr_at(0, train)
    theirs = prec2.optimizer(
        model2, lr=lr, betas=train.betas, weight_decay=train.weight_decay, seed=3
    )
    assert type(ours) is type(theirs)
    assert _groups(ours) == _groups(theirs)
    assert [ours.format_of(p) for p in model.parameters()] == [  # type: ignore[operator]
        theirs.format_of(p)  # type: ignore[operator]
        for p in model2.parameters()
    ]


@pytest.mark.parametrize(("name", "args"), [("sgd", {"momentum": 0.9}), ("lion", {})])
def test_other_optimizers_keep_the_policy_master_and_moments(
    name: str, args: dict[str, Any]
) -> None:
    train = resolve_train(load_workload("digits", size="tiny").defaults, {"lr": 0.05}, name)
    prec, model = _prepared("bf16_lean")
    opt = build_optimizer(prec, model, name, args, train)
    assert type(opt).__name__ == {"sgd": "SGD", "lion": "Lion"}[name]
    (group,) = _groups(opt)
    assert group["moments"] == prec.plan.moments.name and group["lr"] == lr_at(0, train)
    assert group["weight_decay"] == train.weight_decay
    assert ("betas" in group) == (name == "lion")
    assert {opt.format_of(p)[0] for p in model.parameters() if p.dtype == torch.bfloat16} == {  # type: ignore[operator]
        prec.plan.master.name
    }
    if name == "sgd":
        assert group["momentum"] == 0.9


def test_a_recipe_names_its_optimizer_like_a_contract() -> None:
    recipe = Recipe(policy="bf16_master", optimizer="lion", optimizer_args="lr=3e-4")
    assert recipe.train == {"lr": 3e-4} and recipe.optimizer_label == "lion"
    assert recipe.to_dict()["optimizer"] == "lion"
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    plain = Recipe(policy="bf16_master")
    assert "optimizer" not in plain.to_dict() and "optimizer_args" not in plain.to_dict()
    assert dataclasses.replace(plain, optimizer="adamw") == plain
