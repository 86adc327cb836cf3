"""The optimizer-state rule knows every optimizer the issue names (issue 34, item 5):
an SGD with momentum, a Lion, a Muon or an Adafactor over bf16 parameters without a
master is the same trap as bf16 AdamW, plain SGD still rounds each update, and the
finding names what the optimizer at hand keeps and the master for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec.optim
from mixprec.doctor import Finding, check, check_file
from mixprec.doctor.frontends.optimizers import mixprec_state
from mixprec.optim.rules import RULES

from .frontends.cases import NEMO_BASE, write

OS16 = "optimizer-state-16bit"


def _bf16_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(torch.bfloat16)


def _one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()


def _only(findings: list[Finding]) -> Finding:
    assert [f.rule for f in findings] == [OS16], findings
    return findings[0]


def _says_no_adam(f: Finding) -> None:
    for text in (f.message, f.fix):
        assert "Adam" not in text and "moments" not in text, text


def test_torch_sgd_with_momentum_over_bf16_is_the_adamw_trap() -> None:
    model = _bf16_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _one_step(model, opt)
    f = _only(check(model=model, optimizer=opt))
    assert f.severity == "error"
    assert f.evidence["state"] == ["momentum_buffer"] and f.evidence["moments"] == "bf16"
    assert "momentum_buffer is stored in bf16" in f.message
    assert "mixprec.optim.SGD(params, ..., master='exact')" in f.fix
    _says_no_adam(f)


def test_plain_torch_sgd_over_bf16_still_loses_small_updates() -> None:
    model = _bf16_mlp()
    f = _only(check(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    assert f.severity == "error" and f.evidence["state"] == []
    assert "updates below" in f.message and "keeps no state of its own" in f.message
    assert "mixprec.optim.SGD(" in f.fix
    _says_no_adam(f)


def test_mixprec_sgd_with_an_exact_master_passes() -> None:
    model = _bf16_mlp()
    opt = mixprec.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, master="exact")
    _one_step(model, opt)
    assert check(model=model, optimizer=opt) == []


def test_mixprec_rules_without_a_master_name_their_own_state_and_class() -> None:
    model = _bf16_mlp()
    sgd = mixprec.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, master="none")
    f = _only(check(model=model, optimizer=sgd))
    assert f.evidence["state"] == ["momentum_buffer"]
    assert "mixprec.optim.SGD(params, ..., master='exact')" in f.fix
    lion = mixprec.optim.Lion(model.parameters(), lr=1e-4, master="none", moments="bf16")
    g = _only(check(model=model, optimizer=lion))
    assert g.evidence["state"] == ["exp_avg"] and "mixprec.optim.Lion(" in g.fix
    ams = mixprec.optim.AdamW(model.parameters(), amsgrad=True, master="none")
    h = _only(check(model=model, optimizer=ams))
    assert h.evidence["state"] == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]


@pytest.mark.parametrize(
    ("make", "fix"),
    [
        (lambda ps: torch.optim.Muon(ps, lr=0.02), "Mastered(torch.optim.Muon, params"),
        (lambda ps: torch.optim.Adafactor(ps, lr=0.01), "Mastered(torch.optim.Adafactor, params"),
        (lambda ps: torch.optim.RMSprop(ps, lr=0.01), "Mastered(torch.optim.RMSprop, params"),
    ],
)
def test_torch_optimizers_mixprec_has_no_rule_for_are_fixed_by_mastered(
    make: object, fix: str
) -> None:
    model = nn.Linear(16, 16, bias=False).to(torch.bfloat16)  # Muon takes 2-D weights only
    opt = make(list(model.parameters()))  # type: ignore[operator]
    f = _only(check(model=model, optimizer=opt))
    assert f.severity == "error" and f.evidence["master"] == "none" and fix in f.fix
    _says_no_adam(f)


def _lookalike(module: str, name: str) -> type[torch.optim.Optimizer]:
    """A class with another library's module and name (not installed here): the doctor
    recognises them by name, without importing them."""
    cls = type(name, (torch.optim.SGD,), {})
    cls.__module__ = module
    return cls


def test_other_libraries_lion_is_recognised_by_name() -> None:
    model = _bf16_mlp()
    lion = _lookalike("lion_pytorch.lion_pytorch", "Lion")(model.parameters(), lr=1e-4)
    f = _only(check(model=model, optimizer=lion))
    assert f.evidence["state"] == ["exp_avg"] and f.evidence["moments"] == "bf16"
    assert "mixprec.optim.Lion(" in f.fix
    bnb = _lookalike("bitsandbytes.optim.lion", "Lion8bit")(model.parameters(), lr=1e-4)
    g = _only(check(model=model, optimizer=bnb))
    assert g.evidence["moments"] == "int8" and "mixprec.optim.Lion(" in g.fix


def test_mastered_is_recognised_by_name_and_attributes() -> None:
    """``mixprec.optim.Mastered`` (read by its name, its groups' ``master`` and its
    ``inner`` optimizer, so the doctor does not need it importable)."""
    model = _bf16_mlp()

    class Mastered(torch.optim.Optimizer):
        def __init__(self, inner_cls: type, params: object, master: str, **kw: object) -> None:
            params = list(params)  # type: ignore[call-overload]
            super().__init__(params, {"master": master})
            self.inner = inner_cls([torch.zeros(1)], **kw)

    Mastered.__module__ = "mixprec.optim.mastered"
    exact = Mastered(torch.optim.SGD, model.parameters(), master="exact", lr=0.1, momentum=0.9)
    assert check(model=model, optimizer=exact) == []
    none = Mastered(torch.optim.SGD, model.parameters(), master="none", lr=0.1, momentum=0.9)
    f = _only(check(model=model, optimizer=none))
    assert f.evidence["optimizer"] == "mixprec.optim.Mastered(torch.optim.SGD)"


def test_the_doctor_reads_mixprec_state_as_the_rules_define_it() -> None:
    """The config front ends cannot import the rules (torch); their table agrees."""
    cases = {
        ("AdamW", False, 0.0): "adamw",
        ("AdamW", True, 0.0): "adamw_amsgrad",
        ("Adam", True, 0.0): "adam_amsgrad",
        ("SGD", False, 0.0): "sgd",
        ("SGD", False, 0.9): "sgd_momentum",
        ("Lion", False, 0.0): "lion",
    }
    for (cls, amsgrad, momentum), rule in cases.items():
        got = mixprec_state(cls, {"amsgrad": amsgrad, "momentum": momentum})
        assert got == tuple(k for k, _ in RULES[rule].slots), (cls, rule)
        kwargs = {"momentum": momentum} if cls == "SGD" else {}
        if cls in ("Adam", "AdamW"):
            kwargs = {"amsgrad": amsgrad}
        opt = getattr(mixprec.optim, cls)([nn.Parameter(torch.zeros(2))], **kwargs)
        assert opt.rule_of(opt.param_groups[0]).name == rule


def test_a_masterless_policy_warns_for_every_optimizer_not_only_adamw() -> None:
    from mixprec.policy import preset

    (risk,) = preset("bf16_pure").risks()
    assert "SGD" in risk and "AdamW updates" not in risk and "master='exact'" in risk


# -- configs ---------------------------------------------------------------------------


def test_mixprec_config_sgd_with_momentum_without_a_master(tmp_path: Path) -> None:
    pure = "precision:\n  preset: bf16_pure\noptimizer:\n  name: sgd\n  args: {momentum: 0.9}\n"
    f = _only(check_file(write(tmp_path, pure)))
    assert f.evidence["optimizer"] == "mixprec.optim.SGD"
    assert f.evidence["state"] == ["momentum_buffer"]
    assert "optimizer.name: sgd (mixprec.optim.SGD)" in f.fix
    _says_no_adam(f)
    master = "precision:\n  preset: bf16_master\noptimizer:\n  name: sgd\n  args: {momentum: 0.9}\n"
    assert check_file(write(tmp_path, master, "m.yaml")) == []
    torch_sgd = (
        "precision:\n  preset: bf16_pure\noptimizer:\n  name: torch.optim.SGD\n"
        "  args: {momentum: 0.9}\n"
    )
    g = _only(check_file(write(tmp_path, torch_sgd, "t.yaml")))
    assert g.evidence["moments"] == "bf16" and "momentum_buffer" in g.message


def test_hf_trainer_optim_sgd_over_a_bf16_model(tmp_path: Path) -> None:
    recipe = (
        "model_name_or_path: m\ntorch_dtype: bfloat16\noptim: sgd\n"
        "optim_args: momentum=0.9\nmax_steps: 20000\n"
    )
    f = _only(check_file(write(tmp_path, recipe)))
    assert f.severity == "error" and f.evidence["state"] == ["momentum_buffer"]
    plain = "model_name_or_path: m\ntorch_dtype: bfloat16\noptim: sgd\nmax_steps: 20000\n"
    g = _only(check_file(write(tmp_path, plain, "p.yaml")))
    assert g.evidence["state"] == [] and "keeps no state" in g.message


def test_lightning_torch_sgd_with_momentum_under_bf16_true(tmp_path: Path) -> None:
    config = (
        "trainer:\n  precision: bf16-true\n  max_steps: 50000\n"
        "model:\n  class_path: my.Model\n"
        "optimizer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.1\n"
        "    momentum: 0.9\n"
    )
    f = _only(check_file(write(tmp_path, config)))
    assert f.severity == "error" and f.evidence["optimizer"] == "torch.optim.SGD"
    assert f.evidence["state"] == ["momentum_buffer"] and f.evidence["moments"] == "bf16"
    assert "AdamW" not in f.fix and "optimizer state" in f.fix


def test_nemo_recipe_with_torch_sgd_is_told_mixprecs_sgd_not_fused_adam(tmp_path: Path) -> None:
    recipe = NEMO_BASE + "optimizer:\n  _target_: torch.optim.SGD\n  lr: 0.1\n  momentum: 0.9\n"
    f = _only(check_file(write(tmp_path, recipe)))
    assert f.evidence["state"] == ["momentum_buffer"] and f.evidence["moments"] == "bf16"
    assert "optimizer._target_: mixprec.optim.SGD with master: exact" in f.fix
    assert "FusedAdam" not in f.fix
    adam = NEMO_BASE + "optimizer:\n  _target_: torch.optim.AdamW\n  lr: 0.001\n"
    assert "FusedAdam" in _only(check_file(write(tmp_path, adam, "a.yaml"))).fix


def test_a_config_naming_a_torch_optimizer_without_a_mixprec_rule_is_told_mastered(
    tmp_path: Path,
) -> None:
    """Found in review: a mixprec config with torch.optim.Muon was told to use
    mixprec.optim.AdamW (the fallback), a NeMo one a Mastered ``_target_`` it cannot
    spell (Mastered takes the class)."""
    muon = "precision:\n  preset: bf16_pure\noptimizer:\n  name: torch.optim.Muon\n"
    f = _only(check_file(write(tmp_path, muon)))
    assert "mixprec.optim.Mastered(torch.optim.Muon, params" in f.fix and "AdamW" not in f.fix
    nemo = NEMO_BASE + "optimizer:\n  _target_: torch.optim.Adafactor\n  lr: 0.01\n"
    g = _only(check_file(write(tmp_path, nemo, "n.yaml")))
    assert "mixprec.optim.Mastered(torch.optim.Adafactor, params" in g.fix
    assert "_target_: mixprec.optim.Mastered" not in g.fix and "FusedAdam" not in g.fix
