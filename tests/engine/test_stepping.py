"""The step decision: non-finite steps skipped, closures rolled back, collapse detected."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mixprec import LossScaling, Policy, Precision, PrecisionError

from .helpers import grad_step, make_model

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


def test_fp16_injected_inf_skips_exactly_that_step() -> None:
    prec = Precision("amp_fp16")
    model = prec.prepare(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        assert grad_step(prec, model, opt, inject=False).applied
    params_before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    scale_before = prec.loss_scale
    report = grad_step(prec, model, opt, inject=True)
    assert not report.applied and report.skipped
    assert report.nonfinite_grads == 1
    assert not math.isfinite(report.grad_norm)
    assert report.scale == scale_before
    assert prec.loss_scale == scale_before / 2 == report.next_scale
    for k, v in model.state_dict().items():
        assert torch.equal(v, params_before[k]), k
    after = opt.state_dict()
    for idx, st in opt_before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][idx][k], v), (idx, k)
    assert grad_step(prec, model, opt, inject=False).applied
    s = prec.stats
    assert (s.steps, s.applied_steps, s.skipped_steps, s.last_nonfinite_step) == (5, 4, 1, 3)
    assert s.consecutive_skips == 0


@pytest.mark.parametrize("name", ["fp32", "amp_bf16", "bf16_master"])
def test_unscaled_policies_still_skip_nonfinite(name: str) -> None:
    prec = Precision(name)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-2)
    grad_step(prec, model, opt, inject=False)
    before = copy.deepcopy(model.state_dict())
    report = grad_step(prec, model, opt, inject=True)
    assert not report.applied and report.scale is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_lbfgs_under_amp_fp16_with_scaling() -> None:
    torch.manual_seed(0)
    x = torch.randn(128, 8)
    w_true = torch.randn(8, 1)
    y = x @ w_true
    model = nn.Linear(8, 1, bias=False)
    prec = Precision("amp_fp16")
    prec.prepare(model)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=5)
    evals = 0

    def closure() -> torch.Tensor:
        nonlocal evals
        evals += 1
        opt.zero_grad()
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        prec.backward(loss)
        return loss

    with torch.no_grad():
        first = nn.functional.mse_loss(model(x), y).item()
    reports = []
    while sum(r.applied for r in reports) < 6:
        reports.append(prec.step(opt, closure))
        assert len(reports) < 40, "the scale should settle within a few skipped steps"
    with torch.no_grad():
        last = nn.functional.mse_loss(model(x), y).item()
    assert last < 1e-2 * first, (first, last)
    skipped = [r for r in reports if not r.applied]
    # At the initial scale 2**16 this problem's fp16 gradients overflow; the scale backs off.
    assert all(r.next_scale == r.scale / 2 for r in skipped)
    assert evals > len(reports), "LBFGS evaluated the closure several times per step"
    # Plain GradScaler refuses this pattern.
    with pytest.raises(RuntimeError, match="Closure"):
        torch.amp.GradScaler("cpu").step(opt, closure=closure)


def test_closure_with_overflow_in_later_evaluation_rolls_back() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)
    model = nn.Linear(4, 1)
    prec = Precision(
        Policy(compute_dtype=torch.float16, loss_scaling=LossScaling(init_scale=256.0))
    )
    prec.prepare(model)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        with prec.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        prec.backward(loss)
        if calls == 2:
            model.weight.grad[0, 0] = math.nan
        return loss

    before = copy.deepcopy(model.state_dict())
    scale = prec.loss_scale
    report = prec.step(opt, closure)
    assert not report.applied
    assert prec.loss_scale == scale / 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert prec.scaler.state_dict()["_growth_tracker"] == 0
    assert prec.step(opt, closure).applied


def test_collapsing_scale_raises_with_history() -> None:
    prec = Precision("amp_fp16", max_consecutive_skips=None)
    model = prec.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(
        PrecisionError, match=r"loss scale collapsed to 0.5.*Recent loss scales: .*step 16: 1"
    ):
        for _ in range(40):
            grad_step(prec, model, opt, inject=True)
    assert prec.stats.skipped_steps == 17


def test_consecutive_skips_limit_is_configurable() -> None:
    prec = Precision("amp_bf16", max_consecutive_skips=3)
    model = prec.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    grad_step(prec, model, opt, inject=True)
    grad_step(prec, model, opt, inject=True)
    with pytest.raises(PrecisionError, match="3 consecutive steps"):
        grad_step(prec, model, opt, inject=True)
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        Precision("fp32", max_consecutive_skips=0)
