"""Calls the trainers make around `Precision.step`, each once wrong (issue 33).

Trainers clip with torch's own functions after ``prec.unscale_``, run the first
backward themselves, and wrap the optimizer (Accelerate's
``AcceleratedOptimizer``); `Precision.step` must report what really happened
and refuse with its own error.
"""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec import PrecisionError

from .helpers import loss_fn, make_data, make_model


def _backward(prec: mixprec.Precision, model: torch.nn.Module, *, overflow: bool) -> None:
    x, y = make_data(32)
    first = model[0].weight
    hook = first.register_hook(lambda g: torch.full_like(g, float("inf"))) if overflow else None
    with prec.autocast():
        loss = loss_fn(model(x), y)
    prec.backward(loss)
    if hook is not None:
        hook.remove()


def test_an_overflow_clamped_by_clip_grad_value_after_unscale_is_a_skipped_step() -> None:
    """GradScaler saw the inf at ``unscale_`` and skips the update; the clamp made the
    gradients finite, so the report must come from what the scaler found, not a re-check."""
    prec = mixprec.Precision("amp_fp16")
    model = prec.prepare(make_model())
    opt = prec.optimizer(model)
    _backward(prec, model, overflow=True)
    prec.unscale_(opt)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    before = [p.detach().clone() for p in model.parameters()]
    report = prec.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not report.applied
    assert prec.stats.skipped_steps == 1 and prec.stats.applied_steps == 0


def test_a_first_step_without_prec_backward_raises_the_documented_error() -> None:
    prec = mixprec.Precision("amp_fp16")
    model = prec.prepare(make_model())
    opt = prec.optimizer(model)
    x, y = make_data(32)
    with prec.autocast():
        loss = loss_fn(model(x), y)
    loss.backward()
    with pytest.raises(PrecisionError, match=r"prec\.backward"):
        prec.step(opt)


def test_a_clip_on_a_first_step_without_prec_backward_raises_the_documented_error() -> None:
    """A trainer that clips first: the unscale refuses, not GradScaler's assertion
    ("Attempted unscale_ but _scale is None"; found by a docs-only review)."""
    prec = mixprec.Precision("amp_fp16")
    model = prec.prepare(make_model())
    opt = prec.optimizer(model)
    x, y = make_data(32)
    with prec.autocast():
        loss = loss_fn(model(x), y)
    loss.backward()
    with pytest.raises(PrecisionError, match=r"prec\.backward"):
        prec.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(PrecisionError, match=r"prec\.backward"):
        prec.unscale_(opt)


class _Wrapper(torch.optim.Optimizer):
    """Shaped like accelerate's ``AcceleratedOptimizer``: an Optimizer subclass that holds
    the real optimizer as ``.optimizer`` and shares its param groups and state."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.calls = 0

    @property
    def param_groups(self):  # type: ignore[no-untyped-def,override]
        return self.optimizer.param_groups

    @property
    def state(self):  # type: ignore[no-untyped-def,override]
        return self.optimizer.state

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        self.calls += 1
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def test_an_optimizer_wrapper_is_checked_through_the_optimizer_it_wraps() -> None:
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(make_model())
    opt = _Wrapper(prec.optimizer(model))
    _backward(prec, model, overflow=False)
    report = prec.step(opt)
    assert report.applied and opt.calls == 1  # stepped through the wrapper


def test_accelerates_wrapper_is_accepted() -> None:
    accelerate = pytest.importorskip("accelerate")
    prec = mixprec.Precision("bf16_master")
    model = prec.prepare(make_model())
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(model, prec.optimizer(model))
    _backward(prec, model, overflow=False)
    before = model[0].weight.detach().clone()
    assert prec.step(opt).applied
    assert not torch.equal(before, model[0].weight)
