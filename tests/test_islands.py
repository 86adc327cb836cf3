"""fp32 islands: copies, pickles, exceptions, what runs in fp32, and torch.compile."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec.islands import (
    IslandRule,
    add_fp32_island,
    add_fp32_islands,
    is_fp32_island,
    is_norm_layer,
    island_names,
    island_param_names,
    matches_fp32_module,
    remove_fp32_island,
    remove_fp32_islands,
    temporary_fp32_islands,
)
from mixprec.policy import Policy


def _prepared(name: str = "bf16_master") -> tuple[mixprec.Precision, nn.Module]:
    torch.manual_seed(0)
    prec = mixprec.Precision(name)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    return prec, prec.prepare(model)


def _forward(prec: mixprec.Precision, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with prec.autocast():
        return model(x)


def test_islands_keep_fp32_params_and_hand_back_the_input_dtype() -> None:
    prec, model = _prepared()
    assert is_fp32_island(model[1]) and is_fp32_island(model[2])
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    seen: list[torch.dtype] = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = _forward(prec, model, torch.randn(4, 8))
    assert out.dtype == torch.bfloat16 and seen == [torch.bfloat16]
    plain = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    assert list(model.state_dict()) == list(plain.state_dict())


def test_a_deep_copy_uses_its_own_norm_parameters_and_statistics() -> None:
    """The copy's LayerNorm ran with the original's parameters, its gradients landed on
    the original, and its train-mode forward moved the original's BatchNorm statistics."""
    prec, model = _prepared()
    x = torch.randn(4, 8)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[1].weight.zero_()
        twin[1].bias.zero_()
    assert not torch.equal(_forward(prec, twin, x), _forward(prec, model, x))
    running = model[2].running_mean.clone()
    twin.train()
    loss = _forward(prec, twin, x).float().sum()
    loss.backward()
    assert model[1].weight.grad is None and twin[1].weight.grad is not None
    assert torch.equal(model[2].running_mean, running)


def test_averaged_model_of_a_prepared_model() -> None:
    prec, model = _prepared()
    ema = torch.optim.swa_utils.AveragedModel(model)
    ema.update_parameters(model)
    model.eval()
    ema.eval()
    x = torch.randn(4, 8)
    assert torch.equal(_forward(prec, ema, x), _forward(prec, model, x))


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_prepared_model_pickles(how: str) -> None:
    prec, model = _prepared()
    model.eval()
    if how == "pickle":
        again = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        again = torch.load(buf, weights_only=False)
    x = torch.randn(4, 8)
    assert is_fp32_island(again[1])
    assert torch.equal(_forward(prec, again, x), _forward(prec, model, x))


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_autocast_is_restored_when_an_island_raises() -> None:
    module = _Boom()
    add_fp32_island(module, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            module(torch.randn(2, 2))
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_is_off_inside_an_island() -> None:
    """A Linear named as an fp32 module computes in fp32 under bf16 autocast."""
    pol = Policy(
        compute_dtype=torch.bfloat16,
        param_dtype=torch.bfloat16,
        master="exact",
        fp32_modules=("head",),
    )
    prec = mixprec.Precision(pol)
    model = nn.Sequential()
    model.add_module("body", nn.Linear(8, 8))
    model.add_module("head", nn.Sequential(nn.Linear(8, 2)))
    prec.prepare(model)
    inner: list[torch.dtype] = []
    model.head[0].register_forward_hook(lambda m, a, out: inner.append(out.dtype))
    x = torch.randn(3, 8)
    out = _forward(prec, model, x)
    assert inner == [torch.float32] and out.dtype == torch.bfloat16
    with torch.no_grad():
        h = model.body(x.bfloat16()).float()
        assert torch.equal(out, model.head[0](h).bfloat16())


def test_remove_restores_the_module() -> None:
    module = nn.LayerNorm(4)
    add_fp32_island(module, "cpu")
    island = module.forward
    add_fp32_island(module, "cpu")  # idempotent
    assert module.forward is island and is_fp32_island(module)
    remove_fp32_island(module)
    assert not is_fp32_island(module) and "forward" not in vars(module)
    out = module(torch.randn(2, 4, dtype=torch.bfloat16).float())
    assert out.dtype == torch.float32


def test_an_island_runs_a_forward_the_module_already_had_and_gives_it_back() -> None:
    module = nn.Linear(4, 4)
    calls: list[torch.dtype] = []

    def own(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.dtype)
        return x

    module.forward = own  # type: ignore[method-assign]
    add_fp32_island(module, "cpu")
    assert module(torch.ones(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert calls == [torch.float32]
    remove_fp32_island(module)
    assert module.forward is own


class MyRMSNorm(nn.Module):
    pass


class SubLayerNorm(nn.LayerNorm):
    pass


def test_fp32_module_matching() -> None:
    p = mixprec.preset("bf16_master")
    assert matches_fp32_module(p, "blocks.0.ln_1", nn.LayerNorm(4))
    assert matches_fp32_module(p, "x", nn.BatchNorm2d(4))
    assert matches_fp32_module(p, "x", nn.GroupNorm(2, 4))
    assert matches_fp32_module(p, "x", MyRMSNorm())
    assert matches_fp32_module(p, "x", SubLayerNorm(4))
    assert not matches_fp32_module(p, "x", nn.Linear(2, 2))
    by_name = p.replace(fp32_modules=("lm_head",))
    assert matches_fp32_module(by_name, "lm_head", nn.Linear(2, 2))
    assert not matches_fp32_module(by_name, "x", nn.LayerNorm(2))
    by_type = p.replace(fp32_modules=(nn.Embedding,))
    assert matches_fp32_module(by_type, "wte", nn.Embedding(3, 2))


def _norm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16), nn.Linear(16, 2))


def test_the_rule_names_the_modules_and_parameters_of_a_model() -> None:
    model = _norm_model()
    pol = mixprec.preset("bf16_master")
    rule = IslandRule.of(pol)
    assert rule.active and rule.entries == pol.fp32_modules
    assert rule.module_names(model) == ("1", "2")
    assert island_param_names(model, pol) == {"1.weight", "1.bias", "2.weight", "2.bias"}
    # fp32 storage: the patterns still match, but no island applies.
    fp32 = IslandRule.of(mixprec.preset("amp_bf16"))
    assert not fp32.active and fp32.matches("1", model[1])
    assert (
        fp32.module_names(model) == ()
        and island_param_names(model, mixprec.preset("fp32")) == set()
    )
    assert add_fp32_islands(model, fp32, "cpu") == [] and island_names(model) == ()
    assert is_norm_layer(model[1]) and not is_norm_layer(model[0])
    assert rule.covers_class_name("LlamaRMSNorm") and not rule.covers_class_name("Linear")
    assert IslandRule((nn.Linear,)).covers_class_name("Linear")


def test_apply_then_remove_restores_the_model_exactly() -> None:
    model = _norm_model()
    keys = {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
    forwards = {name: m.forward for name, m in model.named_modules()}
    classes = {name: type(m) for name, m in model.named_modules()}
    added = add_fp32_islands(model, mixprec.preset("bf16_master"), "cpu")
    assert added == [model[1], model[2]] and island_names(model) == ("1", "2")
    for name, module in model.named_modules():
        # The class and state_dict keys are the module's own; islands have an
        # instance forward, the others their own.
        assert type(module) is classes[name]
        assert is_fp32_island(module) == (name in ("1", "2"))
        assert is_fp32_island(module) or module.forward == forwards[name]
    assert {k: (v.dtype, v.shape) for k, v in model.state_dict().items()} == keys
    x = torch.randn(4, 8)
    with torch.no_grad():
        with_islands = model(x)
    assert remove_fp32_islands(model) == ("1", "2")
    assert island_names(model) == ()
    for name, module in model.named_modules():
        assert module.forward == forwards[name] and "forward" not in vars(module)
    assert {k: (v.dtype, v.shape) for k, v in model.state_dict().items()} == keys
    with torch.no_grad():
        assert torch.equal(model(x), with_islands)  # fp32 model: islands change nothing
    assert remove_fp32_islands(model) == ()


def test_temporary_islands_keep_the_ones_that_existed() -> None:
    model = _norm_model()
    add_fp32_island(model[1], "cpu")
    with temporary_fp32_islands(model, mixprec.preset("bf16_master"), "cpu"):
        assert island_names(model) == ("1", "2")
    assert island_names(model) == ("1",)


def test_islands_are_the_norms_under_16_bit_storage_only() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert island_param_names(model, mixprec.preset("bf16_master")) == {"1.weight", "1.bias"}
    assert island_param_names(model, mixprec.preset("fp32")) == set()


# ------------------------------------------------------------- torch.compile


_HEAD_AND_NORMS = Policy(
    compute_dtype=torch.bfloat16,
    param_dtype=torch.bfloat16,
    master="exact",
    fp32_modules=("*Norm", "head"),
)


def _body_norm_head() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", nn.Linear(8, 16))
    model.add_module("ln", nn.LayerNorm(16))
    model.add_module("head", nn.Linear(16, 4))
    return model


def _compiled(how: str, prec: mixprec.Precision, model: nn.Module, **options: Any) -> nn.Module:
    """`model` prepared by `prec` and compiled `how` (the three ways torch offers)."""
    if how == "prepare(torch.compile(m))":
        return prec.prepare(torch.compile(model, **options))
    model = prec.prepare(model)
    if how == "torch.compile(m)":
        return torch.compile(model, **options)
    model.compile(**options)
    return model


def _train_and_eval(prec: mixprec.Precision, model: nn.Module, x: torch.Tensor) -> list[Any]:
    """Outputs and gradients of one training forward/backward, then evaluation outputs."""
    with prec.autocast():
        out = model(x)
    out.float().square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    with torch.no_grad():
        evaluated = model(x)
    return [out, *grads, evaluated]


@pytest.mark.compile
@pytest.mark.parametrize("how", ["torch.compile(m)", "m.compile()", "prepare(torch.compile(m))"])
def test_islands_compile_in_one_graph_and_compute_as_in_eager(how: str) -> None:
    """Norm and named-Linear islands compile with fullgraph (no graph break), train
    and evaluate bit for bit as in eager (aot_eager runs eager's aten ops)."""
    x = torch.randn(3, 8)
    prec = mixprec.Precision(_HEAD_AND_NORMS)
    eager = _train_and_eval(prec, prec.prepare(_body_norm_head()), x)
    torch._dynamo.reset()
    prec = mixprec.Precision(_HEAD_AND_NORMS)
    model = _compiled(how, prec, _body_norm_head(), backend="aot_eager", fullgraph=True)
    compiled = _train_and_eval(prec, model, x)
    assert prec.fp32_islands == ("ln", "head")
    assert [t.dtype for t in compiled] == [t.dtype for t in eager]
    assert compiled[-3].dtype == torch.float32  # the head weight gradient: an island
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)


class _BreakingLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = super().forward(x)
        torch._dynamo.graph_break()
        return before + super().forward(x)


@pytest.mark.compile
def test_a_graph_break_inside_an_island_keeps_it_fp32() -> None:
    """dynamo resumes after a break in the island's own forward with autocast off."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", nn.Linear(8, 16))
    model.add_module("head", _BreakingLinear(16, 4))
    prec = mixprec.Precision(_HEAD_AND_NORMS)
    model = prec.prepare(model)
    x = torch.randn(3, 8)
    with prec.autocast():
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")(x)
        assert torch.is_autocast_enabled("cpu")
    head = model.head
    h = model.body(x.bfloat16()).float()
    fp32 = (2 * nn.functional.linear(h, head.weight, head.bias)).bfloat16()
    assert torch.equal(eager, fp32) and torch.equal(compiled, fp32)
