"""Step observers see unscaled gradients around each step."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec import LossScaling, Policy, Precision

from .helpers import grad_step, loss_fn, make_data, make_model

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def before_step(self, prec: Precision, optimizers: object, step: int) -> None:
        grads = [p.grad for p in prec_params(optimizers)]
        self.events.append(
            ("before", (step, prec.gradients_are_scaled, max(float(g.abs().max()) for g in grads)))
        )

    def after_step(self, prec: Precision, optimizers: object, report: mixprec.StepReport) -> None:
        self.events.append(("after", (report.step, report.applied)))


def prec_params(optimizers: object) -> list[torch.Tensor]:
    return [p for opt in optimizers for g in opt.param_groups for p in g["params"]]  # type: ignore[attr-defined]


def test_observers_see_unscaled_gradients_around_each_step() -> None:
    prec = Precision(
        Policy(compute_dtype=torch.float16, loss_scaling=LossScaling(init_scale=2.0**12))
    )
    model = prec.prepare(make_model())
    opt = prec.register(torch.optim.SGD(model.parameters(), lr=1e-3))
    rec = prec.add_observer(Recorder())
    x, y = make_data(32)
    with prec.autocast():
        loss = loss_fn(model(x), y)
    assert not prec.gradients_are_scaled
    prec.backward(loss)
    assert prec.gradients_are_scaled
    prec.step(opt)
    assert not prec.gradients_are_scaled
    grad_step(prec, model, opt, inject=True)
    assert [e[0] for e in rec.events] == ["before", "after", "before", "after"]  # type: ignore[attr-defined]
    (step0, scaled0, gmax0) = rec.events[0][1]  # type: ignore[attr-defined, misc]
    assert step0 == 0 and not scaled0 and gmax0 < 100, "observers see true gradients"
    assert rec.events[3][1] == (1, False)  # type: ignore[attr-defined]
    prec.remove_observer(rec)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="before_step"):
        prec.add_observer(object())  # type: ignore[arg-type]
