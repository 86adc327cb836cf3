"""`Precision("auto", model=..., example_input=...)`: decided by a (mocked) measurement,
with the model, its gradients and the RNG state left as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.speed import Step, StepTimer


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MIXPREC_SPEED_CACHE", raising=False)


def _fake_clock(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[str]:
    """Replace the wall-clock timer by one that runs each step and reports `seconds`."""
    calls: list[str] = []

    def factory(device: object = "cpu", **_: object) -> StepTimer:
        def timer(name: str, step: Step) -> float:
            step()
            calls.append(name)
            return seconds[name]

        return timer

    monkeypatch.setattr("mixprec.speed.measure.wall_clock_timer", factory)
    return calls


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Dropout(0.2), nn.Linear(12, 3))
    return model, torch.randn(4, 6)


@pytest.mark.parametrize(
    ("bf16_seconds", "expected", "ratio"), [(2.41, "fp32", "2.41x"), (0.5, "amp_bf16", "0.50x")]
)
def test_auto_from_a_model_follows_the_measurement(
    monkeypatch: pytest.MonkeyPatch, bf16_seconds: float, expected: str, ratio: str
) -> None:
    calls = _fake_clock(monkeypatch, {"fp32": 1.0, "bf16": bf16_seconds, "fp16": 1.0})
    model, x = _model()
    prec = mixprec.Precision("auto", model=model, example_input=x)
    assert calls, "the steps were timed"
    assert prec.policy.name == expected and prec.plan.policy_name == expected
    assert f"bf16 autocast step {ratio} fp32's" in prec.policy.note
    assert prec.measured is not None and prec.measured.device == "cpu"
    assert mixprec.Precision("auto").measured is None


def test_the_model_gradients_and_rng_are_left_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_clock(monkeypatch, {"fp32": 1.0, "bf16": 2.0, "fp16": 3.0})
    model, x = _model()
    model(x).sum().backward()  # the user's gradients, mid-accumulation
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    mixprec.Precision("auto", model=model, example_input=x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]) and p.dtype == torch.float32
        assert p.grad is not None and torch.equal(p.grad, grads[name])
    assert model.training


def test_a_second_precision_reads_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_clock(monkeypatch, {"fp32": 1.0, "bf16": 2.0, "fp16": 3.0})
    model, x = _model()
    mixprec.Precision("auto", model=model, example_input=x)
    calls.clear()
    prec = mixprec.Precision("auto", model=model, example_input=x)
    assert calls == [] and prec.measured is not None and prec.measured.cache == "hit"


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("fp32", {"model": "m", "example_input": "x"}, "already chosen"),
        (mixprec.preset("amp_bf16"), {"model": "m", "example_input": "x"}, "'amp_bf16'"),
        ("auto", {"model": "m"}, "pass example_input="),
        ("auto", {"example_input": "x"}, "pass model="),
    ],
)
def test_model_and_input_are_for_auto_and_come_together(
    name: object, kwargs: dict[str, object], match: str
) -> None:
    model, x = _model()
    real = {"model": model, "example_input": x}
    with pytest.raises(ValueError, match=match):
        mixprec.Precision(name, **{k: real[k] for k in kwargs})  # type: ignore[arg-type]
