"""`Precision.prepare`: storage dtypes and fp32 islands."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import Precision

from .helpers import make_model

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


def test_prepare_sets_storage_and_keeps_fp32_islands(monkeypatch: pytest.MonkeyPatch) -> None:
    prec = Precision("bf16_master")
    model = prec.prepare(make_model())
    lin, norm = model[0], model[1]
    assert lin.weight.dtype == torch.bfloat16
    assert norm.weight.dtype == torch.float32 and norm.bias.dtype == torch.float32
    seen: list[torch.dtype] = []
    layer_norm = nn.functional.layer_norm

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = layer_norm(x, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(x.dtype)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(nn.functional, "layer_norm", spy)
    x = torch.randn(4, 16)
    with prec.autocast():
        out = model(x)
    assert seen == [torch.float32, torch.float32], "the island computes in fp32 under autocast"
    assert out.dtype == torch.bfloat16
    # Without autocast, a bf16 model still runs: the island hands back bf16.
    out2 = model(x.bfloat16())
    assert out2.dtype == torch.bfloat16
    prec.prepare(model)  # idempotent
    assert lin.weight.dtype == torch.bfloat16


def test_prepare_fp32_policy_keeps_everything_fp32() -> None:
    model = Precision("amp_bf16").prepare(make_model())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_prepare_casts_back_to_fp32() -> None:
    model = make_model().to(torch.bfloat16)
    Precision("fp32").prepare(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_prepare_only_adds_islands_and_casts() -> None:
    """No class changes, state_dict keys stay those of the model, and only the islands
    get an instance forward (`Fp32Island`)."""
    from mixprec.islands import Fp32Island

    plain = make_model()
    model = make_model()
    classes = {name: type(m) for name, m in model.named_modules()}
    Precision("bf16_master").prepare(model)
    assert list(model.state_dict()) == list(plain.state_dict())
    for name, module in model.named_modules():
        assert type(module) is classes[name]
        own = vars(module).get("forward")
        assert isinstance(own, Fp32Island) if name == "1" else own is None
    assert {k: v.dtype for k, v in model.state_dict().items()} == {
        k: torch.float32 if k.startswith("1.") else torch.bfloat16 for k in plain.state_dict()
    }


def test_fp32_islands_names_what_runs_as_an_island_now() -> None:
    """Found by review: the names stayed after islands.remove_fp32_islands(model)."""
    from mixprec import Precision
    from mixprec.islands import remove_fp32_islands

    prec = Precision("bf16_master")
    model = prec.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
    assert prec.fp32_islands == ("1",)
    remove_fp32_islands(model)
    assert prec.fp32_islands == ()


def test_a_prepared_16bit_model_evaluates_fp32_inputs_outside_autocast() -> None:
    """Found in the drop-in review: the README's model failed outside prec.autocast()
    with 'mat1 and mat2 must have the same dtype' (an evaluation loop written the torch way)."""
    from torch import nn

    from mixprec import Precision
    from mixprec.engine.storage import CastInputs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    prec = Precision("bf16_master")
    prec.prepare(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = model(x)  # no autocast: inputs cast to bf16 like FSDP2's cast_forward_inputs
        assert out.dtype == torch.bfloat16
        with prec.autocast():
            inside = model(x)
        hooks = [h for h in model._forward_pre_hooks.values() if isinstance(h, CastInputs)]
        assert len(hooks) == 1
        model._forward_pre_hooks.clear()
        with prec.autocast():
            assert torch.equal(model(x), inside)  # under autocast the hook changes nothing
    prec.prepare(model)
    prec.prepare(model)  # a second prepare keeps one hook
    assert len(model._forward_pre_hooks) == 1
