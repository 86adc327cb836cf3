"""FP8 linear layers under `Precision.prepare` (torchao's float8 training, emulated here)."""

from __future__ import annotations

import copy
import io
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Precision
from mixprec.engine.fp8 import (
    AutocastInput,
    KeptLayer,
    float8_linear_config,
    fp8_hardware,
    fp8_layer_choice,
    is_float8_linear,
)
from mixprec.errors import PrecisionError, PrecisionWarning
from mixprec.policy import FP8_PRESET_NAMES, Float8Training, preset

pytest.importorskip("torchao.float8")

BF16 = torch.bfloat16
RECIPES = dict(zip(FP8_PRESET_NAMES, ("tensorwise", "rowwise", "rowwise_with_gw_hp"), strict=True))


class Net(nn.Module):
    """An input projection, a norm, two eligible blocks, one odd-sized pair and a head."""

    def __init__(self, vocab: int = 20, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.inp = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.odd_in = nn.Linear(width, 24)
        self.odd_out = nn.Linear(24, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.embed(x))
        h = self.norm(h)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.odd_out(torch.relu(self.odd_in(h)))
        return self.head(h)


def batch(seed: int = 0, n: int = 16, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 20, (n, seq), generator=g)
    return x, (x * 7 + 3) % 20  # a fixed map the model can learn


def loss_of(model: nn.Module, prec: Precision, seed: int = 0) -> torch.Tensor:
    x, y = batch(seed)
    with prec.autocast():
        out = model(x)
    return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())


# ------------------------------------------------------------------ the filter


def test_the_filter_keeps_first_last_and_odd_layers_with_their_reasons() -> None:
    convert, kept = fp8_layer_choice(Net(), Float8Training())
    assert [n for n, _ in convert] == ["up", "down"]
    assert kept == [
        KeptLayer("inp", "first nn.Linear (skip_first_last)"),
        KeptLayer("odd_in", "in/out features 32/24 not both divisible by 16"),
        KeptLayer("odd_out", "in/out features 24/32 not both divisible by 16"),
        KeptLayer("head", "last nn.Linear (skip_first_last)"),
    ]


def test_the_filter_options() -> None:
    everything = Float8Training(skip_first_last=False, min_divisor=8, emulate=True)
    convert, kept = fp8_layer_choice(Net(), everything)
    assert [n for n, _ in convert] == ["inp", "up", "down", "odd_in", "odd_out"]
    assert kept == [KeptLayer("head", "in/out features 32/20 not both divisible by 8")]
    convert, kept = fp8_layer_choice(Net(), Float8Training(exclude=("do*", "*_in")))
    assert [n for n, _ in convert] == ["up"]
    assert KeptLayer("down", "excluded by 'do*'") in kept
    assert KeptLayer("odd_in", "excluded by '*_in'") in kept


def test_the_filter_keeps_island_layers_and_linear_subclasses() -> None:
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(
        nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16)), MyLinear(16, 16), nn.Linear(16, 16)
    )
    settings = Float8Training(skip_first_last=False)
    convert, kept = fp8_layer_choice(model, settings, islands=("1",))
    assert [n for n, _ in convert] == ["0", "3"]
    assert kept == [
        KeptLayer("1.0", "inside fp32 island '1'"),
        KeptLayer("2", "MyLinear is an nn.Linear subclass (its forward is its own)"),
    ]
    convert, kept = fp8_layer_choice(model, settings, islands=("",))
    assert convert == [] and kept[0].reason == "inside fp32 island '<model>'"


def test_a_model_with_one_linear_warns_and_trains_in_16_bits() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
    prec = Precision("fp8_tensorwise")
    with pytest.warns(PrecisionWarning, match=r"no nn.Linear of the model qualifies .*the only"):
        model = prec.prepare(model)
    assert prec.fp8 is not None and prec.fp8.converted == ()
    assert prec.fp8.kept == (KeptLayer("0", "the only nn.Linear (skip_first_last)"),)
    assert not any(is_float8_linear(m) for m in model.modules())
    opt = prec.optimizer(model, lr=1e-2)
    with prec.autocast():
        loss = model(torch.randn(4, 32)).float().square().mean()
    prec.backward(loss)
    assert prec.step(opt).applied


def test_a_model_without_linears_warns() -> None:
    with pytest.warns(PrecisionWarning, match="the model has no nn.Linear"):
        Precision("fp8_rowwise").prepare(nn.Sequential(nn.Conv1d(4, 4, 3)))


def test_a_root_linear_is_returned_converted() -> None:
    layer = nn.Linear(32, 32)
    weight = layer.weight
    prec = Precision(preset("fp8_tensorwise").replace(fp8=Float8Training(skip_first_last=False)))
    with pytest.warns(PrecisionWarning, match="skip_first_last=False"):
        out = prec.prepare(layer)
    assert is_float8_linear(out) and out.weight is weight
    assert prec.fp8 is not None and prec.fp8.converted == ("",)


@pytest.mark.compile
def test_a_compiled_root_linear_that_would_convert_is_refused() -> None:
    """torch.compile's wrapper runs the module it was given, not a new Float8Linear."""
    prec = Precision(preset("fp8_tensorwise").replace(fp8=Float8Training(skip_first_last=False)))
    compiled = torch.compile(nn.Linear(32, 32))
    with pytest.warns(PrecisionWarning), pytest.raises(PrecisionError, match="first, then torch"):
        prec.prepare(compiled)


# ------------------------------------------------------------------ the conversion


@pytest.mark.parametrize("name", FP8_PRESET_NAMES)
def test_prepare_converts_and_records(name: str) -> None:
    model = Net()
    params = {n: p for n, p in model.named_parameters()}
    prec = Precision(name)
    assert prec.fp8 is None and prec.plan.fp8 == Float8Training(recipe=RECIPES[name])
    assert "fp8 layers: not known until prepare(model)" in prec.summary()
    out = prec.prepare(model)
    assert out is model
    # parameter identity survives, with the policy's storage: bf16, the norm fp32
    assert {n: p for n, p in model.named_parameters()} == params
    assert all(params[n] is p for n, p in model.named_parameters())
    assert {n for n, p in params.items() if p.dtype != BF16} == {"norm.weight", "norm.bias"}
    assert [n for n, m in model.named_modules() if is_float8_linear(m)] == ["up", "down"]
    assert model.up.config == float8_linear_config(prec.plan.fp8, emulate=True)
    conv = prec.fp8
    assert conv is not None
    assert (conv.recipe, conv.emulate, conv.converted) == (RECIPES[name], True, ("up", "down"))
    assert [k.name for k in conv.kept] == ["inp", "odd_in", "odd_out", "head"]
    assert conv.emulate_reason == "auto: cpu has no FP8 GEMM units: torchao emulates them"
    described = prec.describe()["fp8"]
    assert described["converted"] == ["up", "down"] and described["scaling"] == "dynamic"
    assert described["kept"][0] == {"name": "inp", "reason": "first nn.Linear (skip_first_last)"}
    assert prec.describe()["plan"]["fp8"]["recipe"] == RECIPES[name]
    assert "kept head: last nn.Linear" in prec.summary()
    assert "2 fp8 layers (emulated), 4 kept" in repr(prec)


def test_prepare_twice_keeps_the_conversion() -> None:
    model = Net()
    prec = Precision("fp8_rowwise")
    prec.prepare(model)
    up = model.up
    prec.prepare(model)
    assert model.up is up and len(up._forward_pre_hooks) == 1
    assert prec.fp8 is not None and prec.fp8.converted == ("up", "down")
    with pytest.raises(PrecisionError, match="already a Float8Linear with another torchao"):
        Precision("fp8_tensorwise").prepare(model)


@pytest.mark.parametrize("other", ["bf16_master", "amp_bf16", "fp32"])
def test_a_policy_without_fp8_refuses_a_model_an_fp8_policy_converted(other: str) -> None:
    model = Net()
    Precision("fp8_tensorwise").prepare(model)
    with pytest.raises(PrecisionError, match=r"has no fp8 settings, but the model holds torchao"):
        Precision(other).prepare(model)


class Shared(nn.Module):
    """One eligible Linear registered under two names (b and c), between two ends."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = self.b
        self.d = nn.Linear(32, 32)
        self.e = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.e(self.d(self.c(self.b(self.a(x)))))


def test_a_module_under_two_names_is_kept_whole_with_its_reason() -> None:
    model = Shared()
    prec = Precision("fp8_tensorwise")
    prec.prepare(model)
    assert model.c is model.b and type(model.b) is nn.Linear, "not converted under one name"
    assert prec.fp8 is not None and prec.fp8.converted == ("d",)
    reasons = {k.name: k.reason for k in prec.fp8.kept}
    assert reasons["b"] == (
        "one module under 2 names (b, c): converting one name would leave the others in 16 bits"
    )


def test_real_fp8_gemms_are_refused_where_there_are_none() -> None:
    assert fp8_hardware("cpu") == (False, "cpu has no FP8 GEMM units: torchao emulates them")
    prec = Precision(preset("fp8_tensorwise").replace(fp8=Float8Training(emulate=False)))
    with pytest.raises(PrecisionError, match=r"real FP8 GEMMs \(fp8 emulate=False\)"):
        prec.prepare(Net())


def test_an_fp32_input_under_cpu_autocast_is_cast_for_every_recipe() -> None:
    """torchao casts a Float8Linear's input to the autocast dtype under CUDA autocast only;
    the hook does it on every device (rowwise_with_gw_hp failed on mixed dtypes without)."""
    for name in FP8_PRESET_NAMES:
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
        prec = Precision(name)
        prec.prepare(model)
        h = torch.randn(8, 32)  # fp32, straight into the converted layer
        with prec.autocast():
            out = model[1](h)
        assert out.dtype == BF16
        out.float().square().sum().backward()
        assert model[1].weight.grad is not None and model[1].weight.grad.dtype == BF16
    hook = AutocastInput()
    assert hook(model[1], (h,)) is None  # autocast off: left alone


# ------------------------------------------------------------------ training


@pytest.mark.parametrize("name", FP8_PRESET_NAMES)
def test_each_preset_trains_and_the_loss_falls(name: str) -> None:
    torch.manual_seed(0)
    prec = Precision(name)
    model = prec.prepare(Net())
    opt = prec.optimizer(model, lr=1e-2, weight_decay=0.0)
    assert isinstance(opt, mixprec.optim.AdamW)
    fp8_weight = model.up.weight
    before = fp8_weight.detach().clone()
    losses = []
    for step in range(25):
        loss = loss_of(model, prec, seed=step)
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 1.0)
        assert prec.step(opt).applied
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert model.up.weight is fp8_weight and not torch.equal(fp8_weight, before)
    state = opt.state[fp8_weight]
    assert "remainder" in str(sorted(state)) or len(state) >= 3  # exact master kept


def test_exact_master_equals_a_bf16_master_run_on_the_same_gradients() -> None:
    """The optimizer does not know FP8 exists: fp8 layers' params step like any bf16 param."""
    prec = Precision("fp8_tensorwise")
    model = prec.prepare(Net())
    ref_prec = Precision("bf16_master")
    ref = ref_prec.prepare(copy.deepcopy(Net()))
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = prec.optimizer(model, lr=1e-2), ref_prec.optimizer(ref, lr=1e-2)
    for _ in range(3):
        prec.backward(loss_of(model, prec))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.clone()
        prec.step(opt)
        ref_prec.step(ref_opt)
        opt.zero_grad()
        ref_opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n


# ------------------------------------------------------------------ copies and checkpoints


def test_deepcopy_and_state_dict_interchange_with_the_16_bit_model() -> None:
    prec = Precision("fp8_rowwise_gw_hp")
    model = prec.prepare(Net())
    twin = copy.deepcopy(model)
    assert is_float8_linear(twin.up) and twin.up.weight is not model.up.weight
    assert len(twin.up._forward_pre_hooks) == 1
    x, _ = batch()
    with prec.autocast():
        assert torch.equal(twin(x), model(x))
    # the keys, shapes and dtypes of nn.Linear: a bf16_master model loads them and back
    plain = Precision("bf16_master").prepare(Net())
    sd = model.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in sd.items()} == {
        k: (v.shape, v.dtype) for k, v in plain.state_dict().items()
    }
    plain.load_state_dict(sd)
    fresh = Precision("fp8_rowwise_gw_hp").prepare(Net(width=32))
    fresh.load_state_dict(plain.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd.values(), strict=True)
    )
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert is_float8_linear(loaded.up)


def test_mixprec_checkpoint_save_and_load(tmp_path: Path) -> None:
    prec = Precision("fp8_tensorwise")
    model = prec.prepare(Net())
    opt = prec.optimizer(model, lr=1e-2)
    for step in range(2):
        prec.backward(loss_of(model, prec, seed=step))
        prec.step(opt)
        opt.zero_grad()
    mixprec.checkpoint.save(tmp_path, model=model, optimizer=opt, precision=prec, step=2)
    expected = loss_of(model, prec, seed=5).item()

    prec2 = Precision("fp8_tensorwise")
    model2 = prec2.prepare(Net())
    opt2 = prec2.optimizer(model2, lr=1e-2)
    info = mixprec.checkpoint.load(tmp_path, model=model2, optimizer=opt2, precision=prec2)
    assert info["step"] == 2
    assert loss_of(model2, prec2, seed=5).item() == expected
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
        saved, loaded = opt.state[p].values(), opt2.state[q].values()
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))


# ------------------------------------------------------------------ without torchao


@pytest.fixture
def no_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao as if not installed: its imports raise ImportError."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)


@pytest.mark.usefixtures("no_torchao")
def test_without_torchao_the_presets_are_data_but_prepare_says_the_install_line() -> None:
    for name in FP8_PRESET_NAMES:
        p = mixprec.preset(name)
        prec = Precision(p)  # building the run needs no torchao
        assert prec.plan.fp8 == p.fp8
        with pytest.raises(ImportError, match=r"pip install 'mixprec\[fp8\]'") as info:
            prec.prepare(Net())
        assert f"policy {name!r}" in str(info.value)
        with pytest.raises(ImportError, match="torchao"):
            float8_linear_config(p.fp8, emulate=True)  # type: ignore[arg-type]
    with pytest.raises(ImportError, match="not available"):  # whatever the model
        Precision("fp8_tensorwise").prepare(nn.Sequential(nn.ReLU()))


@pytest.mark.usefixtures("no_torchao")
def test_without_torchao_mixprec_policies_lists_them_and_says_how_to_install(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mixprec.cli import main

    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in FP8_PRESET_NAMES:
        assert name in out
    assert "torchao is not installed: pip install 'mixprec[fp8]'" in out


def test_no_warning_when_layers_convert() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        Precision("fp8_tensorwise").prepare(Net())
