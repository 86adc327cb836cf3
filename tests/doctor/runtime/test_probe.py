from __future__ import annotations

import json
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import mixprec
from mixprec.doctor import Probe, gradient_stats
from mixprec.errors import PrecisionError

# These runs clip still-scaled gradients on purpose (what the doctor must find); the
# engine's own one-time warning about it is tested in tests/engine/test_scaling.py.
pytestmark = pytest.mark.filterwarnings(
    "ignore:gradients were changed in place:mixprec.errors.PrecisionWarning"
)


def _prepare(prec: mixprec.Precision, model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():  # fp16 on CPU is slow: a PerformanceWarning
        warnings.simplefilter("ignore", mixprec.PerformanceWarning)
        return prec.prepare(model)


def _deep_narrow_mlp(depth: int = 14, width: int = 24, std: float = 0.08) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        linear = nn.Linear(width, width)
        nn.init.normal_(linear.weight, std=std)  # small init: gradients shrink layer by layer
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.Tanh()]
    return nn.Sequential(*layers)


def _one_step(policy: str) -> tuple[Probe, nn.Module]:
    prec = mixprec.Precision(policy)
    model = _prepare(prec, _deep_narrow_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Probe(every=1, model=model, overhead_budget=None)
    probe.attach(prec)  # before the forward: the step can be replayed in fp32
    torch.manual_seed(1)
    x, y = torch.randn(32, 24), torch.randn(32, 24)
    with prec.autocast():
        loss = (model(x).float() - y).pow(2).mean()
    prec.backward(loss)
    prec.step(opt)
    return probe, model


def test_fp16_unscaled_deep_mlp_reports_gradient_underflow_with_the_measured_fraction() -> None:
    probe, model = _one_step("fp16_unscaled")
    (f,) = [f for f in probe.findings() if f.rule == "gradient-underflow"]
    assert f.severity == "error" and f.evidence["compute_dtype"] == "fp16"
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    zeros = sum(int((g == 0).sum()) for g in grads)
    total = sum(g.numel() for g in grads)
    assert f.evidence["zero_fraction"] == zeros / total
    assert f.evidence["underflow_zeros"] == zeros  # none structural (test_gradients.py)
    assert f.evidence["zeros"] == zeros and 0.05 < zeros / total < 1.0
    assert probe.samples[0].grads == gradient_stats(grads)


def test_the_same_model_in_fp32_or_with_loss_scaling_loses_no_gradient() -> None:
    probe32, _ = _one_step("fp32")
    assert probe32.samples[0].grads.zeros == 0
    # fp32 gradients this small would underflow in fp16: reported as information only.
    (f,) = probe32.findings()
    assert (f.rule, f.severity) == ("gradient-underflow", "info")
    assert f.evidence["underflow_fraction"] >= 0.01
    scaled, _ = _one_step("amp_fp16")
    assert scaled.samples[0].grads.zero_fraction < 0.05
    assert scaled.findings() == []


def _bf16_param_run(lr: float, steps: int = 3) -> Probe:
    with warnings.catch_warnings():  # bf16_pure warns: the pattern under test
        warnings.simplefilter("ignore", mixprec.PrecisionWarning)
        prec = mixprec.Precision("bf16_pure")
    weight = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = torch.optim.SGD([weight], lr=lr)
    probe = Probe(every=1, overhead_budget=None)
    prec.add_observer(probe)
    for _ in range(steps):
        prec.backward(weight.float().sum())  # gradient 1 for every element
        prec.step(opt)
        opt.zero_grad()
    return probe


def test_tiny_updates_to_bf16_weights_vanish_at_100_percent() -> None:
    probe = _bf16_param_run(lr=1e-4)  # update 1e-4 < half a bf16 ulp of 1.0
    (f,) = probe.findings()
    assert f.rule == "vanishing-updates" and f.severity == "error"
    assert f.evidence["fraction"] == 1.0
    assert f.evidence["intended"] == 64 and f.evidence["vanished"] == 64
    assert f.evidence["times_seen"] == 3
    assert all(s.updates is not None and s.updates.fraction == 1.0 for s in probe.samples)
    summary = probe.summary()
    assert summary["samples"] == 3 and summary["vanishing_update_fraction_max"] == 1.0
    assert "master_unchanged_fraction_mean" not in summary


def test_updates_above_half_an_ulp_land() -> None:
    probe = _bf16_param_run(lr=1e-1)
    assert probe.findings() == []
    assert all(s.updates is not None and s.updates.vanished == 0 for s in probe.samples)


def test_a_master_keeps_tiny_updates() -> None:
    optim = pytest.importorskip("mixprec.optim")
    if not hasattr(optim, "AdamW"):
        pytest.skip("mixprec.optim.AdamW is not available yet")
    prec = mixprec.Precision("bf16_master")
    weight = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = optim.AdamW([weight], lr=1e-5, weight_decay=0.0, master="exact", fused=False)
    cheap = Probe(every=1, overhead_budget=None)
    exact = Probe(every=1, overhead_budget=None, track_masters=True)
    prec.add_observer(cheap)
    prec.add_observer(exact)
    for _ in range(2):
        prec.backward(weight.float().sum())
        prec.step(opt)
        opt.zero_grad()
    assert cheap.findings() == [] and exact.findings() == []
    for probe in (cheap, exact):
        sample = probe.samples[-1]
        assert sample.updates is None  # every 16-bit parameter has a master
        assert sample.master_updates is not None
        # the master moved by ~1e-5 everywhere; the bf16 weight (ulp 2**-7) did not
        assert (sample.master_updates.intended, sample.master_updates.vanished) == (64, 64)
    assert float(opt.master_weights()[0][0]) < 1.0 == float(weight.detach()[0])


def _amp_fp16_setup() -> tuple[mixprec.Precision, nn.Module, torch.optim.Optimizer]:
    prec = mixprec.Precision("amp_fp16")
    torch.manual_seed(0)
    model = _prepare(prec, nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prec.register(opt)
    return prec, model, opt


def _backward(prec: mixprec.Precision, model: nn.Module) -> None:
    with prec.autocast():
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    prec.backward(loss)


def test_clip_before_unscale_is_caught_and_prec_clip_is_not() -> None:
    original = torch.nn.utils.clip_grad_norm_
    prec, model, opt = _amp_fp16_setup()
    probe = Probe(every=1, model=model)
    with probe.watching(prec):
        assert torch.nn.utils.clip_grad_norm_ is original  # nothing is wrapped
        _backward(prec, model)
        prec.clip_grad_norm_(model.parameters(), 1.0)  # unscales first
        prec.step(opt)
        opt.zero_grad()
        assert [f.rule for f in probe.findings()] == []
        _backward(prec, model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still scaled
        prec.step(opt)
    assert torch.nn.utils.clip_grad_norm_ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is original
    assert probe not in prec.observers
    (f,) = probe.findings()
    assert f.rule == "clip-before-unscale" and f.severity == "error"
    assert __file__ in f.where and f.evidence["step"] == 1
    # The clip left the scaled norm at its max_norm (1.0): a true norm of 1 / scale.
    assert f.evidence["loss_scale"] == 2.0**16
    assert f.evidence["scaled_grad_norm"] == pytest.approx(1.0, rel=1e-5)
    assert f.evidence["grad_norm"] == pytest.approx(1.0 / 2.0**16, rel=1e-5)


class _Bomb(nn.Module):
    """Multiplies by inf once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("inf") if self.armed else x


def test_nonfinite_source_names_the_module_that_produced_inf() -> None:
    torch.manual_seed(0)
    bomb = _Bomb()
    model = nn.Sequential(
        OrderedDict(fc1=nn.Linear(8, 8), act=nn.Tanh(), bomb=bomb, fc2=nn.Linear(8, 1))
    )
    prec = mixprec.Precision("fp32")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = Probe(every=1, model=model)
    prec.add_observer(probe)
    reports = []
    for step in range(6):
        bomb.armed = step >= 3
        prec.backward(model(torch.randn(4, 8)).sum())
        reports.append(prec.step(opt))
        opt.zero_grad()
    assert [r.applied for r in reports] == [True, True, True, False, False, False]
    (f,) = probe.findings()
    assert f.rule == "nonfinite-source" and f.where == "bomb"
    assert f.evidence["module_type"] == "_Bomb" and f.evidence["inputs_finite"] is True
    assert f.evidence["first_nonfinite_step"] == 3 and f.evidence["found_at_step"] == 4
    assert all(not m._forward_hooks for m in model.modules())  # hooks removed once found


class _Overflow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e6  # past fp16's max under autocast: inf at any loss scale


def test_a_run_that_keeps_overflowing_reports_loss_scale_collapse() -> None:
    prec = mixprec.Precision("amp_fp16")
    torch.manual_seed(0)
    model = _prepare(
        prec, nn.Sequential(OrderedDict(fc1=nn.Linear(8, 8), big=_Overflow(), fc2=nn.Linear(8, 1)))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = Probe(every=1, model=model)
    prec.add_observer(probe)
    with pytest.raises(PrecisionError, match="collapsed"):
        for _ in range(40):
            _backward(prec, model)
            prec.step(opt)
            opt.zero_grad()
    by_rule = {f.rule: f for f in probe.findings()}
    collapse = by_rule["loss-scale-collapse"]
    assert collapse.severity == "error"
    assert collapse.evidence["current_scale"] < collapse.evidence["init_scale"] / 2**8
    assert collapse.evidence["skipped_in_window"] == collapse.evidence["window_steps"]
    assert collapse.evidence["skipped_with_nonfinite_loss"] == collapse.evidence["window_steps"]
    assert "the loss was inf/NaN" in collapse.message and "forward" in collapse.message
    assert by_rule["nonfinite-source"].where == "big"


def test_a_collapse_from_a_backward_overflow_says_backward() -> None:
    prec = mixprec.Precision("amp_fp16")
    torch.manual_seed(0)
    model = _prepare(prec, nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = Probe(every=1, model=model)
    prec.add_observer(probe)
    x = torch.randn(4, 8)
    with pytest.raises(PrecisionError, match="collapsed"):
        for _ in range(40):
            with prec.autocast():
                # A finite loss whose gradient (1e6 / 4 at any scale >= 1) overflows fp16.
                loss = model(x).float().mean() * 1e6
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad()
    by_rule = {f.rule: f for f in probe.findings()}
    collapse = by_rule["loss-scale-collapse"]
    assert collapse.evidence["skipped_with_finite_loss"] == collapse.evidence["window_steps"]
    assert "the loss was finite" in collapse.message and "backward" in collapse.message
    assert "first module with inf output" not in collapse.fix
    assert "nonfinite-source" not in by_rule  # every forward output stayed finite


def test_a_healthy_scaled_run_has_no_collapse() -> None:
    prec, model, opt = _amp_fp16_setup()
    probe = Probe(every=5, model=model, overhead_budget=None)  # exactly every 5 steps
    prec.add_observer(probe)
    for _ in range(20):
        _backward(prec, model)
        prec.step(opt)
        opt.zero_grad()
    assert probe.findings() == []
    assert [s.step for s in probe.samples] == [0, 5, 10, 15]
    json.dumps([s.to_dict() for s in probe.samples])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "every must be an integer >= 1, got 0"),
        ({"zero_threshold": 1.5}, "zero_threshold must be in"),
        ({"max_hunts": -1}, "max_hunts must be an integer >= 0"),
    ],
)
def test_probe_arguments_are_validated(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Probe(**kwargs)  # type: ignore[arg-type]


def test_nonfinite_hunter_ignores_a_fake_tensor_forward() -> None:
    """memory.estimate runs a fake-tensor forward; with the hunter's hooks in place it
    raised DataDependentOutputException (an fp16 run that overflowed at step 0)."""
    from mixprec.doctor.runtime.hunter import NonfiniteHunter
    from mixprec.memory import estimate

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    hunter = NonfiniteHunter(model)
    hunter.install()
    try:
        x = torch.randn(4, 8)
        predicted = estimate(model, "amp_fp16", inputs=x, loss_fn=lambda o, t: o.float().mean())
        assert predicted.bytes.activations > 0 and hunter.hit is None
        model(torch.full((4, 8), float("inf")))  # real tensors are still hunted
        assert hunter.hit is not None and hunter.hit.module == "0"
    finally:
        hunter.remove()
