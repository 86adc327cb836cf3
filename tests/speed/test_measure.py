"""`measure_speed` with a fake timer: both choices, the cache, the model left untouched."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.device import DeviceCaps, device_caps
from mixprec.speed import SpeedMeasurement, measure_speed

from .conftest import FakeTimer, refusing_timer

SLOW_BF16 = {"fp32": 1.0, "bf16": 2.41, "fp16": 9.0}
FAST_BF16 = {"fp32": 1.0, "bf16": 0.45, "fp16": 9.0}
ALL = ("fp32", "bf16", "fp16")


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))
    return model, torch.randn(5, 8)


def test_picks_fp32_when_bf16_autocast_measures_slower(
    fake_timer: Callable[..., FakeTimer],
) -> None:
    model, x = _model()
    timer = fake_timer(SLOW_BF16)
    m = measure_speed(model, x, formats=ALL, label="tiny mlp", timer=timer, repeats=3)
    assert m.choice() == "fp32"
    assert m.ratios() == {"fp32": 1.0, "bf16": pytest.approx(2.41), "fp16": pytest.approx(9.0)}
    assert len(timer.calls) == 3 * (1 + 3), "one warm-up and three timed steps per format"
    policy = mixprec.policy.resolve_auto(measured=m)
    assert policy.name == "fp32"
    assert "auto chose fp32" in policy.note and "measured" in policy.note
    assert (
        "bf16 autocast step 2.41x fp32's (median 2.41x), fp16 autocast step 9.00x fp32's "
        "(median 9.00x) on this CPU at these shapes" in policy.note
    )
    assert "tiny mlp: Sequential (212 params), input (5, 8) float32" in policy.note


def test_picks_bf16_for_shapes_where_bf16_measures_faster(
    fake_timer: Callable[..., FakeTimer],
) -> None:
    m = measure_speed(shapes="64x32x16", formats=ALL, timer=fake_timer(FAST_BF16), device="cpu")
    assert m.choice() == "bf16" and m.target == "matmuls 64x32x16"
    policy = mixprec.policy.resolve_auto(measured=m)
    assert policy.name == "amp_bf16" and policy.param_dtype == torch.float32
    assert "bf16 autocast step 0.45x fp32's" in policy.note


def test_fp16_choice_is_the_loss_scaled_preset(fake_timer: Callable[..., FakeTimer]) -> None:
    m = measure_speed(
        shapes="8x8x8", formats=ALL, timer=fake_timer({"fp32": 1.0, "bf16": 0.8, "fp16": 0.4})
    )
    policy = mixprec.policy.resolve_auto(measured=m)
    assert policy.name == "amp_fp16" and policy.loss_scaling is not None
    assert mixprec.policy.resolve_auto(measured=m, margin=0.7).name == "fp32"


@pytest.mark.parametrize(
    ("bf16", "expected"),
    [
        ([5.0, 0.7, 3.2, 3.2], "fp32"),  # a lucky quiet step: 0.70x by best, 1.07x by median
        ([5.0, 3.2, 0.7, 2.6], "bf16"),  # 0.70x by best, 0.87x by median
    ],
)
def test_a_16bit_format_needs_the_margin_by_best_and_by_median(
    bf16: list[float], expected: str, fake_timer: Callable[..., FakeTimer]
) -> None:
    timer = fake_timer({"fp32": [5.0, 1.0, 3.0, 3.0], "bf16": bf16})
    m = measure_speed(shapes="8x8x8", formats=["fp32", "bf16"], timer=timer, repeats=3)
    assert m.times()["fp32"] == 1.0 and m.medians()["fp32"] == 3.0, "warm-up samples dropped"
    assert m.ratios()["bf16"] == pytest.approx(0.7)
    assert m.choice() == expected
    data = json.loads(json.dumps(m.to_dict()))
    assert data["choice"] == expected and data["best_s"]["fp32"] == 1.0
    assert data["median_ratio_to_fp32"]["bf16"] == pytest.approx(m.medians()["bf16"] / 3.0)
    assert data["cache"] == "miss"


def test_unaccelerated_formats_are_not_measured_unless_asked(
    monkeypatch: pytest.MonkeyPatch, fake_timer: Callable[..., FakeTimer]
) -> None:
    caps = dataclasses.replace(
        device_caps("cpu"),
        bf16_fast=True,
        fp16_fast=False,
        fp16_reason="no fp16 hardware here",
    )
    monkeypatch.setattr("mixprec.speed.measure.device_caps", lambda device=None: caps)
    timer = fake_timer(SLOW_BF16)
    m = measure_speed(shapes="8x8x8", timer=timer, repeats=1, warmup=0)
    assert set(m.samples) == {"fp32", "bf16"} and m.skipped == {"fp16": "no fp16 hardware here"}
    assert "fp16" not in timer.calls
    assert "fp16 not measured: no fp16 hardware here" in m.explain()
    m = measure_speed(shapes="8x8x8", timer=timer, formats=ALL, repeats=1, warmup=0)
    assert set(m.samples) == set(ALL), "named formats are measured on any device that runs them"
    unsupported = dataclasses.replace(caps, bf16_supported=False, bf16_reason="no bf16 at all")
    monkeypatch.setattr("mixprec.speed.measure.device_caps", lambda device=None: unsupported)
    m = measure_speed(shapes="8x8x8", timer=timer, formats=ALL, repeats=1, warmup=0)
    assert "bf16" not in m.samples and "no bf16 at all" in m.skipped["bf16"]


def test_cache_miss_then_hit_then_refresh_and_off(
    fake_timer: Callable[..., FakeTimer], private_cache: Path
) -> None:
    first = measure_speed(shapes="8x8x8", formats=ALL, timer=fake_timer(SLOW_BF16))
    assert first.cache == "miss" and first.cache_path is not None
    assert Path(first.cache_path).parent == private_cache / "speed"
    hit = measure_speed(shapes="8x8x8", formats=ALL, timer=refusing_timer)
    assert hit.cache == "hit" and hit.samples == first.samples and hit.choice() == "fp32"
    assert "from the cache" in hit.explain()
    other = measure_speed(shapes="8x8x9", formats=ALL, timer=fake_timer(FAST_BF16))
    assert other.cache == "miss" and other.choice() == "bf16", "another shape, another entry"
    fresh = measure_speed(shapes="8x8x8", formats=ALL, timer=fake_timer(FAST_BF16), cache="refresh")
    assert fresh.cache == "refresh" and fresh.choice() == "bf16"
    assert measure_speed(shapes="8x8x8", formats=ALL, timer=refusing_timer).choice() == "bf16"
    off = measure_speed(shapes="8x8x8", formats=ALL, timer=fake_timer(SLOW_BF16), cache="off")
    assert off.cache == "off" and off.cache_path is None and off.choice() == "fp32"
    assert measure_speed(shapes="8x8x8", formats=ALL, timer=refusing_timer).choice() == "bf16"


def test_environment_bypasses_the_cache(
    monkeypatch: pytest.MonkeyPatch, fake_timer: Callable[..., FakeTimer], private_cache: Path
) -> None:
    measure_speed(shapes="8x8x8", formats=ALL, timer=fake_timer(SLOW_BF16))
    monkeypatch.setenv("MIXPREC_SPEED_CACHE", "off")
    timer = fake_timer(FAST_BF16)
    m = measure_speed(shapes="8x8x8", formats=ALL, timer=timer)
    assert m.cache == "off" and timer.calls and m.choice() == "bf16"


def test_corrupt_cache_entry_is_measured_again_and_replaced(
    fake_timer: Callable[..., FakeTimer],
) -> None:
    first = measure_speed(shapes="8x8x8", formats=ALL, timer=fake_timer(SLOW_BF16))
    assert first.cache_path is not None
    Path(first.cache_path).write_text('{"schema": 1, "key": {}, "samp', encoding="utf-8")
    again = measure_speed(shapes="8x8x8", formats=ALL, timer=fake_timer(FAST_BF16))
    assert again.cache == "corrupt" and again.choice() == "bf16"
    assert measure_speed(shapes="8x8x8", formats=ALL, timer=refusing_timer).cache == "hit"


def test_unwritable_cache_still_measures(
    fake_timer: Callable[..., FakeTimer], tmp_path: Path
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    m = measure_speed(
        shapes="8x8x8", formats=ALL, timer=fake_timer(SLOW_BF16), cache_dir=blocker / "speed"
    )
    assert m.cache == "unwritable" and m.choice() == "fp32"


def test_the_model_its_gradients_and_the_rng_are_unchanged(
    fake_timer: Callable[..., FakeTimer],
) -> None:
    model, x = _model()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    measure_speed(model, x, formats=ALL, timer=fake_timer(SLOW_BF16), cache="off")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "0.weight")
    assert model.training and torch.is_grad_enabled()


def test_steps_run_with_gradients_on_under_no_grad(fake_timer: Callable[..., FakeTimer]) -> None:
    seen: list[bool] = []
    model, x = _model()
    model.register_forward_hook(lambda m, a, out: seen.append(out.requires_grad))
    with torch.no_grad():
        measure_speed(model, x, formats=["fp32"], timer=fake_timer(SLOW_BF16), warmup=0, repeats=1)
    assert seen == [True]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "give a model"),
        ({"model": nn.Linear(2, 2), "shapes": "2x2x2"}, ValueError, "not both"),
        ({"model": nn.Linear(2, 2)}, ValueError, "pass example_input"),
        ({"shapes": "2x2"}, ValueError, "bad matmul shape"),
        ({"shapes": [1, 2, 3]}, TypeError, "MxNxK"),
        ({"shapes": "2x2x2", "formats": ["fp8"]}, ValueError, "formats must name"),
        ({"shapes": "2x2x2", "repeats": 0}, ValueError, "repeats must be an int >= 1"),
        ({"shapes": "2x2x2", "warmup": -1}, ValueError, "warmup"),
        ({"shapes": "2x2x2", "cache": "maybe"}, ValueError, "not a cache mode"),
        (
            {"model": lambda x: x, "example_input": torch.ones(2)},
            TypeError,
            "model must be a torch.nn.Module, got function",
        ),
        (
            {"model": nn.Linear(2, 2, device="meta"), "example_input": torch.ones(1, 2)},
            ValueError,
            "the model is on the meta device",
        ),
    ],
)
def test_bad_requests_are_refused(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        measure_speed(timer=refusing_timer, **kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a model on CPU asked to time on CUDA")
def test_model_on_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match="the model is on cpu"):
        measure_speed(nn.Linear(2, 2), torch.ones(1, 2), device="cuda", timer=refusing_timer)


def test_measurement_is_validated_plain_data() -> None:
    m = SpeedMeasurement(
        device="cpu",
        device_name="x",
        target="t",
        threads=1,
        torch_version="2",
        warmup=0,
        repeats=1,
        samples={"bf16": (2.0,), "fp32": (1.0,)},
    )
    assert list(m.samples) == ["fp32", "bf16"], "in candidate order"
    with pytest.raises(ValueError, match="must include fp32"):
        dataclasses.replace(m, samples={"bf16": (1.0,)})


def test_resolve_auto_refuses_a_measurement_of_another_device(
    fake_timer: Callable[..., FakeTimer],
) -> None:
    m = measure_speed(shapes="8x8x8", formats=["fp32"], timer=fake_timer(SLOW_BF16), device="cpu")
    assert mixprec.policy.resolve_auto("cpu", measured=m).name == "fp32"
    with pytest.raises(ValueError, match="measured on cpu, not on cuda"):
        mixprec.policy.resolve_auto("cuda", measured=m)


def test_device_facts_fallback_says_nothing_was_measured() -> None:
    note = mixprec.policy.resolve_auto("cpu").note
    assert "from device facts, nothing measured" in note


_ = DeviceCaps


def test_an_interrupted_measurement_caches_nothing_and_counts_are_bounded(
    fake_timer: Callable[..., FakeTimer], private_cache: Path
) -> None:
    timer = fake_timer(SLOW_BF16)
    with pytest.raises(KeyboardInterrupt):
        measure_speed(
            shapes="8x8x8", formats=ALL, timer=timer, should_stop=lambda: len(timer.calls) >= 3
        )
    assert not private_cache.exists() or not any(private_cache.iterdir())
    with pytest.raises(ValueError, match="repeats must be at most 1000, got 1001"):
        measure_speed(shapes="8x8x8", repeats=1001, timer=fake_timer(SLOW_BF16))


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).detach()


@pytest.mark.parametrize(
    "model",
    [nn.ReLU(), nn.Linear(2, 2).requires_grad_(False), _Detached()],
    ids=["no parameters", "all frozen", "detached output"],
)
def test_a_model_without_a_training_step_is_refused_in_one_line(
    model: nn.Module, fake_timer: Callable[..., FakeTimer]
) -> None:
    with pytest.raises(ValueError, match="the loss does not depend on any trainable parameter"):
        measure_speed(
            model, torch.ones(1, 2), formats=ALL, timer=fake_timer(SLOW_BF16), cache="off"
        )
