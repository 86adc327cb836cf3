"""The step decision: non-finite steps skipped, closures rolled back, collapse detected."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from mixprec import LossScaling, Policy, Precision, PrecisionError, PrecisionWarning, StepReport

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


#: Parameters stored in fp16 (no loss scaling: GradScaler refuses fp16 gradients).
FP16_STORAGE = Policy(name="fp16_storage", param_dtype=torch.float16, master="fp32")


def _ascend(prec: Precision, model: nn.Module, opt: torch.optim.Optimizer) -> StepReport:
    """A step whose gradients are finite (-1 for every weight) and push the weights up."""
    opt.zero_grad(set_to_none=True)
    loss = -model(torch.ones(1, 4, dtype=model.weight.dtype)).float().sum()
    prec.backward(loss)
    return prec.step(opt)


def test_an_update_that_overflows_fp16_storage_is_reported_and_warned_once() -> None:
    prec = Precision(FP16_STORAGE)
    model = prec.prepare(nn.Linear(4, 2))
    with torch.no_grad():
        model.weight.fill_(65000.0)  # fp16 max is 65504
        model.bias.zero_()
    opt = prec.optimizer(model, lr=1000.0, weight_decay=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _ascend(prec, model, opt)
        second = _ascend(prec, model, opt)
    # The gradients were finite, so the steps were applied; the new weights were not.
    assert first.applied and first.nonfinite_grads == 0 and math.isfinite(first.grad_norm)
    assert torch.isinf(model.weight).all() and torch.isfinite(model.bias).all()
    assert first.nonfinite_weights == second.nonfinite_weights == model.weight.numel()
    messages = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert len(messages) == 1, messages
    assert "overflowed fp16" in messages[0] and "8 elements" in messages[0]


@pytest.mark.parametrize("policy", ["fp32", "bf16_master", FP16_STORAGE])
def test_updates_within_range_report_no_nonfinite_weights(policy: str | Policy) -> None:
    prec = Precision(policy)
    model = prec.prepare(nn.Linear(4, 2))
    opt = prec.optimizer(model, lr=1e-2)
    assert _ascend(prec, model, opt).nonfinite_weights == 0


@pytest.mark.parametrize(
    ("overflow", "said"),
    [
        ("backward", r"the loss was finite.*overflow is in the backward pass"),
        ("forward", r"the loss itself was inf/NaN.*forward pass or the loss"),
    ],
)
def test_a_collapse_says_where_the_overflow_was_seen(overflow: str, said: str) -> None:
    prec = Precision("amp_fp16", max_consecutive_skips=None)
    model = prec.prepare(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with pytest.raises(PrecisionError, match=said):
        for _ in range(40):
            with prec.autocast():
                out = model(x)  # fp16
                if overflow == "forward":
                    out = out * 1e6  # past fp16's max: the loss is inf
                # The loss's gradient, 1e6 / 4 at a scale of 1, overflows fp16 in backward.
                loss = out.float().mean() * 1e6 if overflow == "backward" else out.float().mean()
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["fp32", "bf16_master", "amp_fp16"])
def test_a_skipped_step_reports_whether_its_loss_was_finite(name: str) -> None:
    """`StepReport.loss_finite` on a skipped step: False when a loss given to
    `prec.backward` this step was inf/NaN, True when only a gradient was; the note is
    forgotten at the end of each step (a skip after a NaN loss does not taint the next)."""
    prec = Precision(name, max_consecutive_skips=None)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-2)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for finite_loss in (False, True, False):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss * (1.0 if finite_loss else math.nan))
        model[3].weight.grad[0, 0] = math.inf  # a finite loss's step is skipped too
        report = prec.step(opt)
        opt.zero_grad(set_to_none=True)
        assert not report.applied
        assert report.loss_finite is finite_loss


@pytest.mark.parametrize("name", ["fp32", "bf16_master"])
def test_a_skipped_step_without_prec_backward_does_not_know_where(name: str) -> None:
    prec = Precision(name)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-2)
    with prec.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(8, 16)).float(), torch.zeros(8).long())
    loss.backward()
    model[3].weight.grad[0, 0] = math.nan
    report = prec.step(opt)
    assert not report.applied and report.loss_finite is None
