"""FP8 linears in the memory accounting: the replay of torchao's casts against the
measured windows (byte for byte), estimate against measure on an MLP and the workload GPT
per preset, a model where nothing converts, and what a bare count can say."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mixprec import Precision
from mixprec.errors import PrecisionError
from mixprec.memory import (
    FP8_RECIPE_CASTS,
    MemoryBreakdown,
    estimate,
    fp8_layer_transients,
    measure,
)
from mixprec.policy import preset

from .gpt import gpt_and_batch, shape_of

pytest.importorskip("torchao.float8")

FP8_PRESETS = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp")

#: Relative tolerances, estimate against measure (0: byte for byte).
TOLERANCE = {
    "state": 0.0,  # params, fp32 islands, grads, master, moments
    "fp8_cast_temporaries": 0.0,  # the replay of torchao 0.18's eager casts
    "activations": 0.15,  # as test_measurement.py holds every preset
}

STATE = ("params", "fp32_islands", "grads", "master", "moments")


class _Mlp(nn.Module):
    """Four linears: the first and last stay 16-bit (skip_first_last), two convert."""

    def __init__(self, dims: tuple[int, ...] = (16, 64, 96, 48, 16)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=i % 2 == 0) for i, (a, b) in enumerate(itertools.pairwise(dims))
        )
        self.norm = nn.LayerNorm(dims[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.norm(self.layers[-1](x))


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).square().mean()


def _estimate_and_measure(
    name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Callable[..., torch.Tensor]
) -> tuple[MemoryBreakdown, MemoryBreakdown, MemoryBreakdown]:
    """(estimate before prepare, estimate after prepare, measure) of one step."""
    before = estimate(model, name, inputs=x, loss_fn=loss, targets=y)
    prec = Precision(name)
    model = prec.prepare(model)
    opt = prec.optimizer(model, lr=1e-3)
    after = estimate(model, prec.policy, inputs=x, loss_fn=loss, targets=y)

    def step() -> None:
        with prec.autocast():
            out = model(x)
        prec.backward(loss(out, y))
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    return before, after, measure(model, opt, step, policy=prec.policy)


def _agree(predicted: MemoryBreakdown, got: MemoryBreakdown) -> None:
    for comp in STATE:
        assert getattr(predicted.bytes, comp) == pytest.approx(
            getattr(got.bytes, comp), rel=TOLERANCE["state"]
        ), comp
    assert predicted.bytes.activations == pytest.approx(
        got.bytes.activations, rel=TOLERANCE["activations"]
    )
    assert predicted.bytes.fp8_cast_temporaries == pytest.approx(
        got.bytes.fp8_cast_temporaries, rel=TOLERANCE["fp8_cast_temporaries"]
    )


def test_recipe_table_is_torchaos() -> None:
    float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.config import ScalingGranularity, ScalingType

    def granularity(cast: object) -> str | None:
        if cast.scaling_type is ScalingType.DISABLED:  # type: ignore[attr-defined]
            return None
        axis = cast.scaling_granularity is ScalingGranularity.AXISWISE  # type: ignore[attr-defined]
        return "rowwise" if axis else "tensorwise"

    assert set(FP8_RECIPE_CASTS) == {r.value for r in float8.Float8LinearRecipeName}
    for recipe, ours in FP8_RECIPE_CASTS.items():
        c = float8.Float8LinearConfig.from_recipe_name(recipe)
        assert (
            ours.input,
            ours.weight,
            ours.grad_output,
            ours.weight_for_grad_input,
            ours.grad_output_for_grad_weight,
            ours.input_for_grad_weight,
        ) == tuple(
            granularity(x)
            for x in (
                c.cast_config_input,
                c.cast_config_weight,
                c.cast_config_grad_output,
                c.cast_config_weight_for_grad_input,
                c.cast_config_grad_output_for_grad_weight,
                c.cast_config_input_for_grad_weight,
            )
        ), recipe
        assert ours.pow2_scales == c.round_scales_to_power_of_2, recipe
        assert ours.fast_accum == (
            c.gemm_config_output.use_fast_accum,
            c.gemm_config_grad_input.use_fast_accum,
            c.gemm_config_grad_weight.use_fast_accum,
        ), recipe


@pytest.mark.parametrize("name", FP8_PRESETS)
@pytest.mark.parametrize(
    ("tokens", "k", "n", "bias"),
    [(64, 32, 48, True), (128, 64, 32, False), (48, 16, 256, True), (24, 256, 16, False)],
)
def test_one_layer_replay_is_the_measured_peak_byte_for_byte(
    name: str, tokens: int, k: int, n: int, bias: bool
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, k), nn.Linear(k, n, bias=bias), nn.Linear(n, 16))
    x, y = torch.randn(tokens, 16), torch.randn(tokens, 16)
    _, _, got = _estimate_and_measure(name, model, x, y, _mse)
    assert got.fp8 is not None and got.fp8.emulate and got.fp8.layer == "1"
    recipe = preset(name).fp8.recipe  # type: ignore[union-attr]
    assert (got.fp8.forward, got.fp8.backward) == fp8_layer_transients(
        recipe, tokens, k, n, emulate=True, bias=bias
    )


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_estimate_equals_measure_on_an_mlp(name: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 32, 16), torch.randn(4, 32, 16)
    before, after, got = _estimate_and_measure(name, _Mlp(), x, y, _mse)
    for predicted in (before, after):
        _agree(predicted, got)
        assert predicted.fp8 is not None and got.fp8 is not None
        assert predicted.fp8.converted == got.fp8.converted == 2
        assert (predicted.fp8.forward, predicted.fp8.backward, predicted.fp8.layer) == (
            got.fp8.forward,
            got.fp8.backward,
            got.fp8.layer,
        )
    assert got.bytes.fp8_cast_temporaries > 0


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_estimate_and_transformer_shape_equal_measure_on_the_workload_gpt(name: str) -> None:
    wl, model, x, y = gpt_and_batch("small")
    shape = estimate(shape_of(model, x), name)
    before, after, got = _estimate_and_measure(name, model, x, y, wl.loss)  # type: ignore[attr-defined]
    for predicted in (before, after):
        _agree(predicted, got)
    # The closed form sizes the same largest layer (the MLP) as the real model.
    assert shape.bytes.fp8_cast_temporaries == got.bytes.fp8_cast_temporaries


def test_fp8_saves_what_a_16_bit_linear_saves() -> None:
    """torchao saves the high-precision input and weight: activations are bf16_master's."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 32, 16), torch.randn(4, 32, 16)
    _, bf16_est, bf16 = _estimate_and_measure("bf16_master", _Mlp(), x, y, _mse)
    for name in FP8_PRESETS:
        torch.manual_seed(0)
        _, est, got = _estimate_and_measure(name, _Mlp(), x, y, _mse)
        assert got.bytes.activations == bf16.bytes.activations
        assert est.bytes.activations == bf16_est.bytes.activations
    assert bf16.fp8 is None and bf16.bytes.fp8_cast_temporaries == 0


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_no_layer_converts_estimate_is_bf16_masters(name: str) -> None:
    """Dims not divisible by 16: every linear stays 16-bit and so does the memory."""
    torch.manual_seed(0)
    dims = (10, 40, 24, 40, 10)
    x, y = torch.randn(4, 8, 10), torch.randn(4, 8, 10)
    ref = estimate(_Mlp(dims), "bf16_master", inputs=x, loss_fn=_mse, targets=y)
    before, after, got = _estimate_and_measure(name, _Mlp(dims), x, y, _mse)
    for predicted in (before, after):
        assert predicted.bytes == ref.bytes and predicted.per_rank == ref.per_rank
        assert predicted.fp8 is not None and predicted.fp8.converted == 0
    assert got.bytes.fp8_cast_temporaries == 0
    assert got.fp8 is not None and got.fp8.converted == 0


def test_a_bare_count_says_the_state_and_not_the_casts() -> None:
    ref = estimate(1_000_000, "bf16_master")
    for name in FP8_PRESETS:
        b = estimate(1_000_000, name)
        assert b.bytes == ref.bytes and b.state_bytes_per_param == 14
        assert b.fp8 is not None and not b.fp8.estimated and b.fp8.forward is None
        assert any("fp8 cast temporaries not estimated" in n for n in b.notes)
        d = b.to_dict()
        assert d["fp8"]["estimated"] is False and d["per_rank"]["fp8_cast_temporaries"] == 0


def test_a_transformer_shape_without_eligible_dims_has_no_fp8_memory() -> None:
    from mixprec.memory import TransformerShape

    shape = TransformerShape(n_layer=2, hidden=40, n_head=2, vocab=100, seq_len=8)
    b = estimate(shape, "fp8_tensorwise")
    assert b.fp8 is not None and b.fp8.estimated and b.fp8.peak == 0
    assert b.bytes == estimate(shape, "bf16_master").bytes


def test_a_module_without_inputs_counts_its_converted_layers_only() -> None:
    b = estimate(_Mlp(), "fp8_rowwise")
    assert b.fp8 is not None and b.fp8.converted == 2 and not b.fp8.estimated
    assert b.bytes.fp8_cast_temporaries == 0


def test_fp8_units_against_hand_counts() -> None:
    """M = K = N = 64 (n = 4096 elements per tensor), tensorwise, bf16, no bias.

    A cast of n bf16 values holds at most x.to(fp32) * scale (4n), its clamp (4n) and
    the fp8 copy (n): 9n, plus the 4-byte scale. Forward: the input's fp8 copy (n + 4)
    while the weight is cast (9n + 4): 10n + 8; FP8 units then hold 2n + 8 and the
    inverse scales (8). Emulated, the GEMM dequantizes the input (4n kept) and then the
    weight (8n at once): 2n + 8 + 4n + 8n = 14n + 8.
    Backward: grad_output's and the weight's fp8 copies stay until backward returns;
    when the input is cast for grad_weight, three fp8 copies (3n + 12) sit beside the
    cast (9n + 4): 12n + 16. Emulated, the grad_weight GEMM dequantizes both operands
    (4n + 8n at once) beside four fp8 copies and the two layout copies (6n + 16):
    18n + 16.
    """
    n = 64 * 64
    real = fp8_layer_transients("tensorwise", 64, 64, 64, emulate=False, bias=False)
    assert real == (10 * n + 8, 12 * n + 16)
    emulated = fp8_layer_transients("tensorwise", 64, 64, 64, emulate=True, bias=False)
    assert emulated == (14 * n + 8, 18 * n + 16)


def test_device_picks_the_gemm_path() -> None:
    _wl, model, x, _ = gpt_and_batch("small")
    shape = shape_of(model, x)
    cpu = estimate(shape, "fp8_rowwise", device_type="cpu")
    forced = dataclasses.replace(
        preset("fp8_rowwise"),
        name="fp8_rowwise_units",
        fp8=dataclasses.replace(preset("fp8_rowwise").fp8, emulate=False),  # type: ignore[arg-type]
    )
    units = estimate(shape, forced, device_type="cpu")
    assert cpu.fp8 is not None and cpu.fp8.emulate
    assert units.fp8 is not None and not units.fp8.emulate
    assert units.bytes.fp8_cast_temporaries < cpu.bytes.fp8_cast_temporaries


def test_bad_layer_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="unknown fp8 recipe 'delayed'"):
        fp8_layer_transients("delayed", 8, 16, 16, emulate=True)
    with pytest.raises(ValueError, match="tokens must be a positive integer, got 0"):
        fp8_layer_transients("tensorwise", 0, 16, 16, emulate=True)


def test_estimate_refuses_what_prepare_refuses_on_a_converted_model() -> None:
    """A model an FP8 policy converted: another recipe or a policy without fp8 is refused
    by `prepare`, and by `estimate` with the same error; the same recipe estimates."""
    model = Precision("fp8_tensorwise").prepare(_Mlp())
    x = torch.randn(8, 16)
    same = estimate(model, "fp8_tensorwise", inputs=x, loss_fn=_mse, targets=torch.randn(8, 16))
    assert same.fp8 is not None and same.fp8.converted == 2
    for name, match in (
        ("fp8_rowwise", r"layer 'layers\.1' is already a Float8Linear with another torchao"),
        ("bf16_master", r"'bf16_master' has no fp8 settings, but the model holds torchao"),
        ("fp32", r"holds torchao Float8Linear layers \(layers\.1, layers\.2\)"),
    ):
        with pytest.raises(PrecisionError, match=match) as refused:
            Precision(name).prepare(model)
        with pytest.raises(PrecisionError, match=match) as got:
            estimate(model, name, inputs=x, loss_fn=_mse, targets=torch.randn(8, 16))
        assert "\n" not in str(got.value)
        assert str(got.value).replace("estimate a model", "prepare a model") == str(refused.value)


def test_transformer_shape_sizes_the_linears_of_a_gqa_llama() -> None:
    """The closed form lists the linear shapes a grouped-query Llama has (k and v
    projections narrower than q; no biases): it assumed GPT's square projections."""
    from hf_models import tiny_llama
    from mixprec.memory import TransformerShape
    from mixprec.memory.fp8 import transformer_fp8_layers

    config = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    config |= {"num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256}
    with torch.device("meta"):
        model = tiny_llama(**config)
    built = {
        (m.in_features, m.out_features, m.bias is not None)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name != "lm_head"
    }
    shape = TransformerShape.from_config(
        {**config, "model_type": "llama", "hidden_act": "silu"}, seq_len=64
    )
    predicted = transformer_fp8_layers(shape, preset("fp8_rowwise"))
    assert {(layer.in_features, layer.out_features, layer.bias) for layer in predicted} == built
