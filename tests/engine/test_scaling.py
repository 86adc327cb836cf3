"""Loss scaling: the scale trajectory, static scales, unscale before clip."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mixprec import LossScaling, Policy, Precision

from .helpers import grad_step, loss_fn, make_data, make_model

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


def test_loss_scale_trajectory_equals_gradscaler() -> None:
    ls = LossScaling(init_scale=2.0**10, growth_interval=3)
    prec = Precision(Policy(compute_dtype=torch.float16, loss_scaling=ls))
    model = prec.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1e-3)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    overflow_at = {1, 2, 6, 7, 8, 15, 16}
    x, y = make_data(32)
    ours, theirs = [], []
    for i in range(20):
        grad_step(prec, model, opt, inject=i in overflow_at)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ref_model(x), y)
        ref.scale(loss).backward()
        if i in overflow_at:
            ref_model[3].weight.grad[0, 0] = math.inf
        ref.step(ref_opt)
        ref.update()
        ref_opt.zero_grad(set_to_none=True)
        ours.append(prec.loss_scale)
        theirs.append(ref.get_scale())
    assert ours == theirs
    assert prec.stats.skipped_steps == len(overflow_at)
    assert prec.stats.scale_history[0][0] == 0


def test_static_loss_scale_never_moves_but_skips() -> None:
    prec = Precision(Policy(compute_dtype=torch.float16, loss_scaling=LossScaling.static(128.0)))
    model = prec.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = [grad_step(prec, model, opt, inject=i == 2) for i in range(5)]
    assert [r.applied for r in reports] == [True, True, False, True, True]
    assert {r.scale for r in reports} == {128.0}
    assert prec.loss_scale == 128.0


def test_clip_sees_true_norm_equal_to_fp32_run() -> None:
    x, y = make_data(64)
    norms = {}
    for name in ["fp32", "amp_fp16"]:
        prec = (
            Precision(
                Policy(compute_dtype=torch.float16, loss_scaling=LossScaling(init_scale=2.0**14))
            )
            if name == "amp_fp16"
            else Precision("fp32")
        )
        model = prec.prepare(make_model())
        opt = prec.register(torch.optim.SGD(model.parameters(), lr=0.0))
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        norm = prec.clip_grad_norm_(model.parameters(), 1e-3)
        clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        report = prec.step(opt)
        norms[name] = (norm.item(), clipped.item(), report.grad_norm)
    ref, fp16 = norms["fp32"], norms["amp_fp16"]
    assert fp16[0] == pytest.approx(ref[0], rel=1e-2), "clip saw the unscaled norm"
    assert fp16[1] == pytest.approx(1e-3, rel=1e-3), "and clipped the true gradients"
    assert fp16[2] == fp16[0], "the report carries the pre-clip true norm"


def test_clip_under_scaling_needs_a_known_optimizer() -> None:
    prec = Precision("amp_fp16")
    model = prec.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = make_data(32)
    with prec.autocast():
        loss = loss_fn(model(x), y)
    prec.backward(loss)
    with pytest.raises(ValueError, match=r"prec.register\(optimizer\)"):
        prec.clip_grad_norm_(model.parameters(), 1.0)
    prec.clip_grad_norm_(model.parameters(), 1.0, optimizer=opt)
    assert prec.step(opt).applied


def test_backward_scales_the_loss() -> None:
    prec = Precision(Policy(compute_dtype=torch.float16, loss_scaling=LossScaling(init_scale=8.0)))
    w = nn.Parameter(torch.ones(3))
    prec.backward((w * 2).sum())
    assert torch.equal(w.grad, torch.full((3,), 16.0))
    assert repr(prec).startswith("Precision('custom'")


def test_torch_clip_on_scaled_gradients_is_loud_once_and_prec_unscale_silences_it() -> None:
    import warnings as _warnings

    from mixprec import Precision, PrecisionWarning

    def run(fix: str) -> list[str]:
        torch.manual_seed(0)
        prec = Precision("amp_fp16", device="cpu")
        model = prec.prepare(torch.nn.Linear(8, 8))
        opt = prec.optimizer(model, lr=1e-3)
        with _warnings.catch_warnings(record=True) as caught:
            _warnings.simplefilter("always")
            for _ in range(2):
                with prec.autocast():
                    loss = model(torch.randn(4, 8)).float().pow(2).mean()
                prec.backward(loss)
                if fix == "prec.unscale_":
                    prec.unscale_(opt)
                if fix == "prec.clip":
                    prec.clip_grad_norm_(model.parameters(), 1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                prec.step(opt)
                opt.zero_grad(set_to_none=True)
        return [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]

    loud = run("none")
    assert len(loud) == 1 and "clip_grad_norm_ there clips the scaled gradients" in loud[0]
    assert run("prec.unscale_") == []
    assert run("prec.clip") == []
