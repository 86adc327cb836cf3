"""clip-before-unscale without patching torch: the engine notes gradients changed in place
while still scaled; the probe reads that note."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_ as imported_before_the_run

import mixprec
from mixprec.doctor import Probe

# These runs clip still-scaled gradients on purpose (what the doctor must find); the
# engine's own one-time warning about it is tested in tests/engine/test_scaling.py.
pytestmark = pytest.mark.filterwarnings(
    "ignore:gradients were changed in place:mixprec.errors.PrecisionWarning"
)


CLIP_FUNCTIONS = (
    (torch.nn.utils, "clip_grad_norm_"),
    (torch.nn.utils, "clip_grad_value_"),
    (torch.nn.utils.clip_grad, "clip_grad_norm_"),
    (torch.nn.utils.clip_grad, "clip_grad_value_"),
)


def _torch_clip_functions() -> list[object]:
    return [getattr(module, name) for module, name in CLIP_FUNCTIONS]


def _setup() -> tuple[mixprec.Precision, nn.Module, torch.optim.Optimizer]:
    prec = mixprec.Precision("amp_fp16")
    torch.manual_seed(0)
    with warnings.catch_warnings():  # fp16 on CPU is slow: a PerformanceWarning
        warnings.simplefilter("ignore", mixprec.PerformanceWarning)
        model = prec.prepare(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prec.register(opt)
    return prec, model, opt


def _backward(prec: mixprec.Precision, model: nn.Module) -> None:
    with prec.autocast():
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    prec.backward(loss)


def test_torch_clip_functions_are_the_same_objects_before_during_and_after_a_run() -> None:
    before = _torch_clip_functions()
    prec, model, opt = _setup()
    probe = Probe(every=1, model=model)
    during = []
    with probe.watching(prec):
        for _ in range(2):
            _backward(prec, model)
            during.append(_torch_clip_functions())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            during.append(_torch_clip_functions())
            prec.step(opt)
            opt.zero_grad()
    probe.attach(prec)
    during.append(_torch_clip_functions())
    probe.detach()
    after = _torch_clip_functions()
    for seen in (*during, after):
        assert all(a is b for a, b in zip(seen, before, strict=True))
    assert [f.rule for f in probe.findings()] == ["clip-before-unscale"]


def test_a_clip_function_imported_before_the_run_is_caught_too() -> None:
    prec, model, opt = _setup()
    probe = Probe(every=1)
    prec.add_observer(probe)  # no watching() needed: nothing is installed
    _backward(prec, model)
    imported_before_the_run(model.parameters(), 1.0)
    prec.step(opt)
    (f,) = probe.findings()
    assert f.rule == "clip-before-unscale" and f.evidence["step"] == 0
    assert __file__ in f.where


def test_clip_grad_value_on_scaled_gradients_is_caught() -> None:
    prec, model, opt = _setup()
    probe = Probe(every=1)
    prec.add_observer(probe)
    _backward(prec, model)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
    assert prec.gradients_changed_while_scaled is False  # noted at the unscale
    prec.step(opt)
    assert prec.gradients_changed_while_scaled is False  # reset by the step
    (f,) = probe.findings()
    assert f.rule == "clip-before-unscale" and f.evidence["loss_scale"] == 2.0**16


@pytest.mark.parametrize("accumulate", [1, 3])
def test_clipping_after_the_unscale_is_not_reported(accumulate: int) -> None:
    prec, model, opt = _setup()
    probe = Probe(every=1, model=model)
    prec.add_observer(probe)
    for step in range(4):
        for _ in range(accumulate):  # accumulation changes gradients inside backward only
            _backward(prec, model)
        if step % 2:
            prec.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            prec.clip_grad_norm_(model.parameters(), 1.0)
        prec.step(opt)
        opt.zero_grad(set_to_none=False)  # zeroed in place between steps: not a change
    assert probe.findings() == []


def test_the_engine_notes_an_in_place_change_only_before_the_unscale() -> None:
    prec, model, opt = _setup()
    seen: list[bool] = []

    class Spy:
        def before_step(self, prec: mixprec.Precision, optimizers: object, step: int) -> None:
            seen.append(prec.gradients_changed_while_scaled)

        def after_step(self, prec: mixprec.Precision, optimizers: object, report: object) -> None:
            pass

    prec.add_observer(Spy())
    _backward(prec, model)
    prec.step(opt)
    _backward(prec, model)
    with torch.no_grad():
        next(model.parameters()).grad.mul_(0.5)  # type: ignore[union-attr]
    prec.step(opt)
    assert seen == [False, True]
