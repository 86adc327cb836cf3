"""`prec.optimizer` keeps the user's param groups exactly (drop-in for torch's loop)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Precision


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _decay_groups(model: nn.Module) -> list[dict[str, object]]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [
        p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)
    ]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _prepared(name: str = "bf16_master") -> tuple[Precision, nn.Module]:
    torch.manual_seed(0)
    prec = Precision(name)
    return prec, prec.prepare(_Net())


def test_two_groups_stay_two_groups_with_islands_inside() -> None:
    prec, model = _prepared()
    opt = prec.optimizer(_decay_groups(model), lr=1e-3)
    assert len(opt.param_groups) == 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    norm_weight = model.norm.weight
    assert norm_weight.dtype == torch.float32  # an fp32 island in the no-decay group
    assert opt.format_of(norm_weight) == ("none", "fp32")
    assert opt.format_of(model.fc1.weight) == ("exact", "fp32")


def test_per_group_scheduler_lists_work() -> None:
    prec, model = _prepared()
    opt = prec.optimizer(_decay_groups(model), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5])
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-3, 2e-3], total_steps=10)
    x = torch.randn(8, 16)
    for _ in range(3):
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        assert prec.step(opt).applied
        opt.zero_grad(set_to_none=True)
        sched.step()
        one_cycle.step()
    assert len({g["lr"] for g in opt.param_groups}) == 2


def test_a_two_group_torch_checkpoint_loads() -> None:
    torch.manual_seed(0)
    ref_model = _Net()
    ref = torch.optim.AdamW(_decay_groups(ref_model), lr=1e-3)
    out = ref_model(torch.randn(4, 16)).pow(2).mean()
    out.backward()
    ref.step()
    prec = Precision("amp_bf16")
    model = prec.prepare(_Net())
    model.load_state_dict(ref_model.state_dict())
    opt = prec.optimizer(_decay_groups(model), lr=1e-3)
    opt.load_state_dict(ref.state_dict())
    assert opt.last_conversion is not None and opt.last_conversion.params == 6


def test_generators_and_named_params_are_read_once_and_kept() -> None:
    prec, model = _prepared("amp_bf16")
    opt = prec.optimizer([{"params": model.parameters()}], lr=1e-3)
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))


def test_building_the_optimizer_before_prepare_names_the_fix() -> None:
    prec = Precision("bf16_master")
    with pytest.raises(Exception, match=r"built before prec\.prepare"):
        prec.optimizer(_Net())


def test_formats_other_than_the_policy_s_are_refused_and_lr_may_be_positional() -> None:
    prec, model = _prepared()
    with pytest.raises(ValueError, match=r"decides master \('exact'\)"):
        prec.optimizer(model, master="fp32")
    with pytest.raises(ValueError, match=r"decides moments \('fp32'\)"):
        prec.optimizer(model, moments="int8")
    opt = prec.optimizer(model, 1e-2, master="exact", moments="fp32")
    assert opt.param_groups[0]["lr"] == 1e-2


def test_a_group_cannot_ask_for_other_formats_than_the_policy_s() -> None:
    """Found by the second review: group keys slipped past the refusal of master=/moments=."""
    prec, model = _prepared()
    with pytest.raises(ValueError, match=r"group 0 asks for master='kahan'"):
        prec.optimizer([{"params": list(model.parameters()), "master": "kahan"}])
    with pytest.raises(ValueError, match=r"group 0 asks for moments='int8'"):
        prec.optimizer([{"params": list(model.parameters()), "moments": "int8"}])


def test_a_model_made_only_of_fp32_islands_gets_its_optimizer() -> None:
    """Found by review: a LayerNorm alone under bf16_master was refused as "built
    before prepare", although prepare had kept it fp32 by design."""

    prec = mixprec.Precision("bf16_master")
    for model in (torch.nn.LayerNorm(8), torch.nn.Sequential(torch.nn.LayerNorm(8))):
        model = prec.prepare(model)
        opt = prec.optimizer(model)
        assert opt.formats() == [("none", "fp32")] * 2  # fp32 params are their own master
    with pytest.raises(mixprec.PrecisionError, match=r"before prec\.prepare"):
        mixprec.Precision("bf16_master").optimizer(torch.nn.Linear(2, 2))  # still caught


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("SGD", {"lr": 0.1, "momentum": 0.9}), ("Lion", {"lr": 1e-3}), ("Adam", {"amsgrad": True})],
)
def test_a_mixprec_optimizer_class_is_built_with_the_policys_formats(
    name: str, kwargs: dict[str, object]
) -> None:
    """prec.optimizer(optimizer=mixprec.optim.SGD) built Mastered around it (a torch-style
    wrapper with fp32 inner state) instead of the class itself with the plan's formats."""
    import mixprec.optim

    cls = getattr(mixprec.optim, name)
    prec = Precision(mixprec.preset("bf16_master").replace(moments="int8"))
    model = prec.prepare(nn.Linear(256, 64))
    opt = prec.optimizer(model, optimizer=cls, **kwargs)
    assert type(opt) is cls
    assert set(opt.formats()) == {("exact", "int8"), ("exact", "fp32")}  # (a 64-bias: fp32)
    model(torch.randn(8, 256).bfloat16()).float().square().mean().backward()
    assert prec.step(opt).applied


def test_an_optimizer_that_is_not_a_class_names_the_classes() -> None:
    """Found by review: optimizer="sgd" said 'Mastered takes a torch.optim.Optimizer
    subclass', a wrapper the caller never asked for."""
    prec, model = _prepared()
    with pytest.raises(TypeError, match=r"pass the class itself: mixprec.optim.AdamW, Adam, SGD"):
        prec.optimizer(model, optimizer="sgd")  # type: ignore[arg-type]
