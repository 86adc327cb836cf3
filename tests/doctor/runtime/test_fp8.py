"""The fp8 probes: exact counts on constructed tensors, parity with torchao's own scale
and cast, the delayed-scaling what-if, the rules, and runs left bitwise untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

import mixprec
from mixprec.doctor import Probe, ProbeThresholds, check
from mixprec.doctor.runtime import (
    Fp8CastStats,
    cast_counts,
    current_scale,
    delayed_scale,
    fp8_layers,
    fp8_limits,
)
from mixprec.doctor.runtime.schedule import SampleSchedule
from mixprec.engine.fp8 import is_float8_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _torchao() -> None:
    pytest.importorskip("torchao.float8")


def _fp8_mlp(recipe: str, *, seed: int = 0) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU())
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config)
    return model


# ------------------------------------------------------------------ pure counts


def test_limits_are_the_rounding_points_of_each_format() -> None:
    e4m3, e5m2 = fp8_limits(E4M3), fp8_limits(E5M2)
    assert (e4m3.max, e4m3.clip_above, e4m3.flush_at_or_below) == (448.0, 464.0, 2.0**-10)
    assert (e5m2.max, e5m2.clip_above, e5m2.flush_at_or_below) == (57344.0, 61440.0, 2.0**-17)
    with pytest.raises(ValueError, match="not an fp8 dtype"):
        fp8_limits(torch.bfloat16)


def test_counts_are_exact_around_the_max_and_half_the_smallest_subnormal() -> None:
    half_sub = 2.0**-10  # e4m3fn: half its smallest subnormal 2**-9
    x = torch.tensor(
        [
            250.0,  # x 2 = 500: beyond 464, clipped
            232.0,  # 464: the tie, rounds to the max: not clipped
            232.5,  # 465: clipped
            224.0,  # 448: the max itself
            -250.0,  # clipped
            half_sub / 2,  # 2**-10 after scaling: the tie, flushed
            half_sub / 2 * 1.01,  # just above: rounds to the smallest subnormal
            half_sub / 4,  # flushed
            -half_sub / 4,  # flushed
            0.0,  # a zero is not underflow
        ]
    )
    stats = Fp8CastStats.from_row(cast_counts(x, 2.0, fp8_limits(E4M3)).tolist())
    assert (stats.elements, stats.zeros, stats.saturated, stats.underflow) == (10, 1, 3, 3)
    assert stats.saturated_fraction == 3 / 10
    assert stats.underflow_fraction == 3 / 9  # of the non-zero elements
    assert (stats.amax, stats.scale_min, stats.scale_max) == (250.0, 2.0, 2.0)
    # the flush count is what a real cast to e4m3fn turns into zero
    scaled = x * 2.0
    in_range = scaled.abs() <= 448.0
    flushed = (scaled[in_range].to(E4M3).float() == 0) & (x[in_range] != 0)
    assert int(flushed.sum()) == stats.underflow


@pytest.mark.parametrize("round_pow2", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_current_scale_is_torchaos_bit_for_bit(dtype: torch.dtype, round_pow2: bool) -> None:
    _torchao()
    from torchao.float8.float8_utils import amax_to_scale

    amax = torch.tensor([1e-14, 3.3e-7, 0.017, 1.0, 7.5, 448.0, 6.1e4], dtype=torch.float32)
    ours = current_scale(amax, fp8_max=fp8_limits(dtype).max, round_pow2=round_pow2)
    assert torch.equal(ours, amax_to_scale(amax, dtype, round_scales_to_power_of_2=round_pow2))


@pytest.mark.parametrize(("granularity", "dim"), [("tensorwise", None), ("axiswise", -1)])
def test_underflow_counts_what_torchaos_cast_flushes(granularity: str, dim: int | None) -> None:
    _torchao()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    g = torch.Generator().manual_seed(0)
    x = torch.exp(torch.randn(64, 48, generator=g) * 4.0) * torch.sign(torch.randn(64, 48))
    fp8 = hp_tensor_to_float8_dynamic(
        x,
        E4M3,
        LinearMMConfig(),
        scaling_granularity=ScalingGranularity(granularity),
        axiswise_dim=dim,
    )
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = current_scale(amax, fp8_max=448.0, round_pow2=False)
    assert torch.equal(scale, fp8._scale)
    stats = Fp8CastStats.from_row(cast_counts(x, scale, fp8_limits(E4M3)).tolist())
    flushed = int(((fp8._data.float() == 0) & (x != 0)).sum())
    assert stats.underflow == flushed > 0
    assert stats.saturated == 0  # current scaling: nothing clips by construction


def test_delayed_scale_follows_transformer_engine() -> None:
    history = [1.0, 4.0, 2.0]
    assert delayed_scale(history, fp8_max=448.0) == 112.0  # max over the history
    assert delayed_scale(history, fp8_max=448.0, algo="most_recent") == 224.0
    assert delayed_scale(history, fp8_max=448.0, margin=2) == 28.0  # / 2**margin
    assert delayed_scale([], fp8_max=448.0) is None
    assert delayed_scale([0.0], fp8_max=448.0) is None  # TE keeps the previous scale


def test_thresholds_validate_the_what_if_settings() -> None:
    with pytest.raises(ValueError, match="fp8_amax_compute_algo must be one of max"):
        ProbeThresholds(fp8_amax_compute_algo="mean")
    with pytest.raises(ValueError, match="fp8_margin must be an integer >= 0"):
        ProbeThresholds(fp8_margin=-1)
    with pytest.raises(ValueError, match=r"fp8_saturation_threshold must be in \(0, 1\]"):
        ProbeThresholds(fp8_saturation_threshold=0.0)


def test_hook_time_is_charged_to_the_sample() -> None:
    clock = iter(float(t) for t in range(100))
    schedule = SampleSchedule(every=1, overhead_budget=None, clock=lambda: next(clock))
    since = schedule.begin(0)
    schedule.charge_seconds(5.0)
    schedule.charge(since)
    schedule.plan_next(0)
    assert schedule.cost.probe_s == 6.0
    assert schedule.cost.last_sample_s == 6.0


# ------------------------------------------------------------------ the layers


def test_layers_and_their_casts_are_read_from_torchaos_config() -> None:
    _torchao()
    by_recipe = {r: fp8_layers(_fp8_mlp(r)) for r in RECIPES}
    for recipe, layers in by_recipe.items():
        assert [la.name for la in layers] == ["0", "2"]
        assert all(la.recipe == recipe and la.emulate for la in layers)
    tw = by_recipe["tensorwise"][0]
    assert {(c.role, c.dtype, c.gemms) for c in tw.casts} == {
        ("input", E4M3, ("output", "grad_weight")),
        ("weight", E4M3, ("output", "grad_input")),
        ("grad_output", E5M2, ("grad_input", "grad_weight")),
    }
    hp = by_recipe["rowwise_with_gw_hp"][0]
    assert hp.high_precision_gemms == ("grad_weight",)
    assert {(c.role, c.granularity, c.gemms) for c in hp.casts} == {
        ("input", "axiswise", ("output",)),
        ("weight", "axiswise", ("output",)),
        ("weight", "tensorwise", ("grad_input",)),
        ("grad_output", "axiswise", ("grad_input",)),
    }
    assert not is_float8_linear(nn.Linear(4, 4))
    assert fp8_layers(nn.Linear(4, 4)) == ()


# ------------------------------------------------------------------ probed runs


def _run(
    model: nn.Module,
    probe: Probe | None,
    *,
    steps: int,
    batch: Callable[[int], torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    prec = mixprec.Precision("fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    if probe is not None:
        probe.attach(prec, model)
    for step in range(steps):
        x = batch(step)
        loss = (model(x) ** 2).mean()
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if probe is not None:
        probe.detach()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def _uniform(step: int) -> torch.Tensor:
    x = torch.rand(8, 32, generator=torch.Generator().manual_seed(step)) * 2 - 1
    x[0, 0] = 1.0  # the same amax every step
    return x


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_probed_run_is_bitwise_the_unprobed_run(recipe: str) -> None:
    _torchao()
    probed = _run(_fp8_mlp(recipe), Probe(every=1, overhead_budget=None), steps=4, batch=_uniform)
    plain = _run(_fp8_mlp(recipe), None, steps=4, batch=_uniform)
    assert torch.equal(probed[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(probed[1], plain[1], strict=True))


def test_an_outlier_saturates_under_the_delayed_what_if_only() -> None:
    _torchao()

    def batch(step: int) -> torch.Tensor:
        x = _uniform(step)
        if step == 5:
            x[3, 7] = 1000.0  # 1000 x 448 / 1 is far beyond 464: one element clips
        return x

    probe = Probe(every=1, overhead_budget=None)
    _run(_fp8_mlp("tensorwise"), probe, steps=6, batch=batch)
    sample = probe.samples[5]
    entry = next(t for t in sample.fp8 if (t.layer, t.role) == ("0", "input"))
    assert entry.saturated_fraction == 0.0  # torchao's current scaling: nothing clips
    assert entry.delayed_scale == 448.0  # the history's max amax is 1.0
    assert entry.delayed is not None and entry.delayed.saturated == 1
    assert entry.delayed_saturated_fraction == 1 / 256
    assert entry.history[-1] == 1000.0 and entry.samples == 6
    found = {f.rule: f for f in probe.findings()}
    sat = found["fp8-saturation"]
    assert sat.severity == "info" and sat.evidence["measured"] is False
    assert "what-if" in sat.evidence["scaling"]
    layer0 = next(e for e in sat.evidence["layers"] if (e["layer"], e["role"]) == ("0", "input"))
    assert layer0["delayed_saturated_fraction"] == 1 / 256
    assert layer0["saturated_fraction"] == 0.0 and layer0["steps_sampled"] == 6
    scale = float(torch.tensor(448.0 / 1000.0, dtype=torch.float32))
    assert layer0["format"] == "fp8_e4m3" and layer0["scale"] == scale
    assert probe.fp8_amax_history["0 (input)"][-1] == 1000.0
    # the same outlier, a margin of 11 binary orders: 1000 x 448 / 2**11 < 464, no clip
    quiet = Probe(every=1, overhead_budget=None, fp8_margin=11)
    _run(_fp8_mlp("tensorwise"), quiet, steps=6, batch=batch)
    entry = next(t for t in quiet.samples[5].fp8 if (t.layer, t.role) == ("0", "input"))
    assert entry.delayed is not None and entry.delayed.saturated == 0


def test_one_rows_outlier_flushes_the_other_rows_tensorwise_not_rowwise() -> None:
    _torchao()

    def batch(step: int) -> torch.Tensor:
        x = torch.full((8, 32), 1e-3)
        x[0] = 1e4  # scale 448 / 1e4: the other rows land at 4.5e-5, below 2**-10
        return x

    def input_casts(recipe: str) -> tuple[Probe, dict[tuple[str, ...], float]]:
        probe = Probe(every=1, overhead_budget=None)
        _run(_fp8_mlp(recipe), probe, steps=1, batch=batch)
        entry = next(t for t in probe.samples[0].fp8 if (t.layer, t.role) == ("0", "input"))
        return probe, {c.gemms: c.stats.underflow_fraction for c in entry.casts}

    probe, casts = input_casts("tensorwise")
    assert casts == {("output", "grad_weight"): 7 / 8}
    under = {f.rule: f for f in probe.findings()}["fp8-underflow"]
    assert under.severity == "warning" and under.evidence["fraction"] >= 7 / 8
    layer0 = next(e for e in under.evidence["layers"] if (e["layer"], e["role"]) == ("0", "input"))
    assert layer0["underflow_fraction"] == 7 / 8
    # rowwise: per-row scales keep the forward cast whole; the grad-weight cast scales per
    # column, over the batch, and still flushes; rowwise_with_gw_hp does not cast there
    _, casts = input_casts("rowwise")
    assert casts == {("output",): 0.0, ("grad_weight",): 7 / 8}
    _, casts = input_casts("rowwise_with_gw_hp")
    assert casts == {("output",): 0.0}


def test_emulated_fp8_layers_are_format_not_accelerated() -> None:
    _torchao()
    probe = Probe(every=1, overhead_budget=None)
    _run(_fp8_mlp("rowwise"), probe, steps=1, batch=_uniform)
    found = {f.rule: f for f in probe.findings()}["format-not-accelerated"]
    assert found.severity == "info"
    assert "numerics, not fp8 speed" in found.message
    assert found.evidence["emulate_layers"] == 2
    static = check(model=_fp8_mlp("rowwise"), device="cpu")
    rules = {f.rule: f for f in static}
    assert rules["format-not-accelerated"].severity == "info"
    assert "fp8-without-scaling" not in rules  # torchao's recipes scale


def test_a_fake_tensor_forward_before_a_sampled_step_is_not_measured() -> None:
    # compare's runner predicts memory (a fake-tensor forward through the model) after
    # the probe has armed step 0: the hooks must skip it, or step 0's counts come back fake.
    _torchao()
    model = _fp8_mlp("tensorwise")
    probe = Probe(every=1, overhead_budget=None)
    prec = mixprec.Precision("fp32")
    probe.attach(prec, model)
    x = _uniform(0)
    mixprec.memory.estimate(
        model, "fp8_tensorwise", inputs=x, loss_fn=lambda out, _: (out**2).mean()
    )
    weight_amax = float(model[0].weight.detach().abs().amax())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prec.backward((model(x) ** 2).mean())
    prec.step(opt)
    probe.detach()
    entries = {(t.layer, t.role): t for t in probe.samples[0].fp8}
    assert entries[("0", "weight")].amax == weight_amax
    assert entries[("0", "input")].amax == 1.0  # the real batch, measured once
    assert entries[("0", "input")].casts[0].stats.elements == x.numel()
