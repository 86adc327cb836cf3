"""Fault injection for `Precision`: partial clips, bad clip norms, optimizers that cannot
honour the policy, several optimizers, bad state. Each case was a silent failure once."""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Precision, PrecisionError

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.errors.PerformanceWarning")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))


def _loss(prec: Precision, model: nn.Module) -> torch.Tensor:
    with prec.autocast():
        out = model(torch.randn(4, 8))
    return out.float().pow(2).mean()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["fp32", "amp_bf16", "bf16_master", "amp_fp16", "bf16_lean"])
@pytest.mark.filterwarnings("ignore:gradients were changed in place")  # the injected NaN
def test_nan_outside_a_partial_clip_is_never_applied(name: str) -> None:
    """NaN in the head's bias, clip on the body only: the step used to trust the clip."""
    prec = Precision(name)
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-2)
    prec.backward(_loss(prec, model))
    head_bias = model[2].bias
    assert head_bias.grad is not None
    head_bias.grad[0] = float("nan")
    before = _params(model)
    norm = prec.clip_grad_norm_(model[0].parameters(), 1.0)
    assert math.isfinite(float(norm))  # the clip saw only finite gradients
    report = prec.step(opt)
    assert not report.applied and report.nonfinite_grads >= 1
    assert report.stepped == (False,)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


def test_a_full_clip_reports_the_pre_clip_norm() -> None:
    prec = Precision("fp32")
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-2)
    prec.backward(_loss(prec, model) * 1000)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    expected = float(torch.nn.utils.get_total_norm(grads))
    prec.clip_grad_norm_(model.parameters(), 1.0)
    report = prec.step(opt)
    assert report.applied and report.grad_norm == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan, -math.inf])
def test_clip_refuses_a_max_norm_that_is_not_positive(bad: float) -> None:
    prec = Precision("fp32")
    model = prec.prepare(_model())
    prec.optimizer(model)
    prec.backward(_loss(prec, model))
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        prec.clip_grad_norm_(model.parameters(), bad)
    assert all(
        torch.equal(p.grad, g)
        for p, g in zip(model.parameters(), grads, strict=True)
        if p.grad is not None
    )
    with pytest.raises(TypeError, match="max_norm must be a number"):
        prec.clip_grad_norm_(model.parameters(), "1.0")  # type: ignore[arg-type]
    # inf only measures the norm, as in torch.
    assert math.isfinite(float(prec.clip_grad_norm_(model.parameters(), math.inf)))


def test_optimizer_built_before_prepare_is_refused() -> None:
    prec = Precision("bf16_master")
    model = _model()
    with pytest.raises(PrecisionError, match=r"built before prec\.prepare"):
        prec.optimizer(model, lr=1e-3)  # fp32 params now: no master possible
    # An optimizer built elsewhere before prepare is refused at the step.
    opt = prec.register(mixprec.optim.AdamW(model.parameters(), lr=1e-3))
    prec.prepare(model)
    prec.backward(_loss(prec, model))
    before = _params(model)
    with pytest.raises(PrecisionError, match=r"built before prec\.prepare"):
        prec.step(opt)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_torch_adamw_under_a_master_policy_is_refused() -> None:
    prec = Precision("bf16_master")
    model = prec.prepare(_model())
    opt = prec.register(torch.optim.AdamW(model.parameters(), lr=1e-3))
    prec.backward(_loss(prec, model))
    with pytest.raises(PrecisionError, match="cannot do"):
        prec.step(opt)


def test_model_cast_after_the_optimizer_is_refused() -> None:
    prec = Precision("bf16_master")
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-3)
    model.to(torch.bfloat16)  # the fp32 LayerNorm island becomes bf16 too
    with prec.autocast():
        loss = model[2](model[0](torch.randn(4, 8))).float().pow(2).mean()
    prec.backward(loss)
    model[1].weight.grad = torch.zeros_like(model[1].weight)
    with pytest.raises(PrecisionError, match="no master"):
        prec.step(opt)
    # The optimizer refuses on its own too (used without Precision).
    with pytest.raises(PrecisionError, match="was fp32 when this optimizer was built"):
        opt.step()


def test_fp32_policy_with_16bit_params_is_refused() -> None:
    prec = Precision("amp_bf16")
    model = prec.prepare(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to(torch.bfloat16)
    prec.backward(_loss(prec, model))
    with pytest.raises(PrecisionError, match="stores parameters in fp32"):
        prec.step(opt)


def test_bf16_pure_with_torch_optimizers_is_what_it_says() -> None:
    prec = Precision("bf16_pure")
    with pytest.warns(mixprec.PrecisionWarning, match="bf16 with no master"):
        model = prec.prepare(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec.backward(_loss(prec, model))
    assert prec.step(opt).applied


def _steps(prec: Precision, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        prec.backward(_loss(prec, model))
        prec.step(opt)
        opt.zero_grad(set_to_none=True)


def test_optimizers_and_the_device_are_checked_once_not_at_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 32: every step re-checked each optimizer and every autocast the device."""
    import mixprec.engine.precision as runtime

    calls: Counter[str] = Counter()

    def counted(name: str, check: Callable[..., None]) -> Callable[..., None]:
        def counting(*args: object) -> None:
            calls[name] += 1
            check(*args)

        return counting

    monkeypatch.setattr(
        runtime, "check_optimizers", counted("optimizers", runtime.check_optimizers)
    )
    monkeypatch.setattr(runtime, "check_compute", counted("device", runtime.check_compute))
    prec = Precision("bf16_master")
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-3)
    _steps(prec, model, opt, 4)
    assert calls == {"optimizers": 1, "device": 1}


def test_a_param_group_added_after_the_first_step_is_checked() -> None:
    prec = Precision("amp_bf16")
    model = prec.prepare(_model())
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    _steps(prec, model, opt, 1)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]})
    prec.backward(_loss(prec, model))
    with pytest.raises(PrecisionError, match="stores parameters in fp32"):
        prec.step(opt)


def test_a_param_group_added_after_the_first_step_is_watched() -> None:
    """The grown optimizer is registered again: a plain backward into the new group's
    parameter, among scaled ones, is refused as for the first group."""
    prec = Precision("amp_fp16")
    model = prec.prepare(_model())
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    _steps(prec, model, opt, 1)
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra]})
    _steps(prec, model, opt, 1)
    prec.backward(_loss(prec, model))
    extra.sum().backward()
    with pytest.raises(PrecisionError, match=r"did not go through prec\.backward"):
        prec.step(opt)


def test_prepare_rechecks_the_optimizers_already_stepped() -> None:
    prec = Precision("bf16_master")
    model = _model()
    opt = prec.register(torch.optim.SGD(model.parameters(), lr=0.1))
    _steps(prec, model, opt, 1)  # fp32 parameters: nothing to refuse yet
    prec.prepare(model)
    prec.backward(_loss(prec, model))
    with pytest.raises(PrecisionError, match="cannot do"):
        prec.step(opt)


def _two_optimizers(name: str) -> tuple[Precision, nn.Module, list[torch.optim.Optimizer]]:
    prec = Precision(name)
    model = prec.prepare(_model())
    body = list(model[0].parameters()) + list(model[1].parameters())
    opt_a = prec.optimizer(body, lr=1e-2)
    opt_b = prec.optimizer(model[2].parameters(), lr=1e-2)
    return prec, model, [opt_a, opt_b]


@pytest.mark.filterwarnings("ignore:gradients were changed in place")  # the injected inf
@pytest.mark.parametrize("name", ["amp_fp16", "fp32", "bf16_master"])
def test_an_inf_in_one_optimizer_skips_every_optimizer(name: str) -> None:
    prec, model, opts = _two_optimizers(name)
    prec.backward(_loss(prec, model))
    model[2].weight.grad[0, 0] = float("inf")
    before = _params(model)
    scale = prec.loss_scale
    report = prec.step(opts)
    assert not report.applied and report.stepped == (False, False)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    if scale is not None:
        assert report.next_scale == scale / 2  # backed off, as GradScaler does
    # The next clean step applies both.
    for o in opts:
        o.zero_grad(set_to_none=True)
    prec.backward(_loss(prec, model))
    assert prec.step(opts).stepped == (True, True)


@pytest.mark.parametrize("name", ["amp_fp16", "fp32"])
def test_an_optimizer_without_gradients_does_not_break_the_step(name: str) -> None:
    """A branch unused this step: GradScaler raised 'No inf checks were recorded'."""
    prec, model, opts = _two_optimizers(name)
    with prec.autocast():
        loss = model[1](model[0](torch.randn(4, 8))).float().pow(2).mean()  # head unused
    prec.backward(loss)
    report = prec.step(opts)
    assert report.applied and report.stepped == (True, False)
    none_at_all = prec.step(opts[1])
    assert none_at_all.applied and none_at_all.stepped == (False,)


def _amp_fp16_after_one_step() -> Precision:
    prec = Precision("amp_fp16")
    model = prec.prepare(_model())
    opt = prec.optimizer(model)
    prec.backward(_loss(prec, model))
    prec.step(opt)
    return prec


def test_precision_load_state_dict_validates_before_changing_anything() -> None:
    prec = _amp_fp16_after_one_step()
    good = copy.deepcopy(prec.state_dict())
    stats_before = prec.stats.to_dict()
    scale_before = prec.loss_scale
    bad_states: list[object] = [
        {},
        None,
        [],
        {**good, "scaler": {**good["scaler"], "scale": math.nan}},
        {**good, "scaler": {**good["scaler"], "scale": -1.0}},
        {**good, "scaler": {**good["scaler"], "scale": "big"}},
        {**good, "stats": {"steps": 1, "nope": 3}},
        {**good, "stats": None},
    ]
    for bad in bad_states:
        with pytest.raises(ValueError):
            prec.load_state_dict(bad)  # type: ignore[arg-type]
        assert prec.stats.to_dict() == stats_before and prec.loss_scale == scale_before
    prec.load_state_dict(good)
    assert prec.stats.to_dict() == stats_before


def test_a_plain_backward_among_scaled_ones_is_refused() -> None:
    """Accumulating prec.backward and loss.backward mixed scaled and unscaled parts."""
    prec = Precision("amp_fp16")
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-2)
    prec.backward(_loss(prec, model))
    _loss(prec, model).backward()
    before = _params(model)
    with pytest.raises(PrecisionError, match=r"did not go through prec\.backward"):
        prec.step(opt)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    # Accumulating through prec.backward only is fine.
    opt.zero_grad(set_to_none=True)
    prec.backward(_loss(prec, model))
    prec.backward(_loss(prec, model))
    report = prec.step(opt)  # not refused: applied, or skipped by the scaler on an overflow
    assert report.applied or report.nonfinite_grads > 0


@pytest.mark.parametrize("name", ["amp_fp16", "fp32", "bf16_master"])
def test_a_step_without_any_gradient_is_a_no_op(name: str) -> None:
    """Under amp_fp16 it raised torch's raw 'Attempted unscale_ but _scale is None'."""
    prec = Precision(name)
    model = prec.prepare(_model())
    opt = prec.optimizer(model)
    before = _params(model)
    report = prec.step(opt)
    assert report.applied and report.stepped == (False,) and report.nonfinite_grads == 0
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_finite_gradient_whose_norm_overflows_is_not_called_non_finite() -> None:
    prec = Precision("fp32")
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-3)
    prec.backward(_loss(prec, model))
    model[0].weight.grad[0, 0] = 2e19  # finite, but its square overflows fp32
    report = prec.step(opt)
    assert report.applied and report.nonfinite_grads == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("scaler", "growth_factor", "x"),
        ("scaler", "growth_factor", -1.0),
        ("scaler", "growth_factor", math.inf),
        ("scaler", "backoff_factor", 5.0),
        ("scaler", "growth_interval", 0),
        ("scaler", "scale", 10**30),
        ("scaler", "scale", 1e39),
        ("scaler", "_growth_tracker", None),
        ("stats", "steps", -5),
        ("stats", "skipped_steps", "x"),
        ("stats", "consecutive_skips", 10**6),
        ("stats", "loss_scale", "x"),
        ("stats", "scale_history", [[-1, math.nan]]),
        ("stats", "history_size", None),
    ],
)
def test_malformed_scaler_or_telemetry_is_refused_and_changes_nothing(
    section: str, key: str, value: object
) -> None:
    prec = _amp_fp16_after_one_step()
    state = copy.deepcopy(prec.state_dict())
    if value is None:
        del state[section][key]
    else:
        state[section][key] = value
    before = (prec.stats.to_dict(), prec.scaler.state_dict())
    with pytest.raises(ValueError):
        prec.load_state_dict(state)
    assert (prec.stats.to_dict(), prec.scaler.state_dict()) == before


def _interrupt(*args: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("name", ["amp_fp16", "bf16_master"])
def test_precision_continues_after_a_step_was_interrupted(name: str) -> None:
    """A Ctrl-C inside prec.step (here from a step pre-hook, before the optimizer wrote
    anything) left GradScaler's iteration open: under amp_fp16 every later step raised
    torch's "unscale_() has already been called on this optimizer since the last update()"."""
    prec = Precision(name)
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-2)
    prec.backward(_loss(prec, model))
    hook = opt.register_step_pre_hook(_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prec.step(opt)
    hook.remove()
    opt.zero_grad(set_to_none=True)
    prec.backward(_loss(prec, model))
    report = prec.step(opt)
    assert report.applied or report.nonfinite_grads > 0
