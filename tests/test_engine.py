from __future__ import annotations

import copy
import importlib
import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import mixprec
from mixprec import LossScaling, Policy, Precision, PrecisionError
from mixprec.device import DeviceCaps
from mixprec.errors import PerformanceWarning, PrecisionWarning
from mixprec.policy import PRESET_NAMES


@pytest.fixture(autouse=True)
def _quiet_expected_warnings() -> Iterator[None]:
    # fp16 on this CPU is not accelerated and bf16_pure is risky: both warn by design,
    # and dedicated tests check those warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        warnings.simplefilter("ignore", PrecisionWarning)
        yield


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.LayerNorm(32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 4),
    )


def make_data(n: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = (x @ w).argmax(dim=1)
    return x, y


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y)


def train(prec: Precision, steps: int, lr: float = 1e-2) -> list[float]:
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=lr, weight_decay=0.0)
    x, y = make_data()
    losses = []
    for i in range(steps):
        xb, yb = x[(i * 32) % 256 :][:32], y[(i * 32) % 256 :][:32]
        with prec.autocast():
            loss = loss_fn(model(xb), yb)
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 5.0)
        report = prec.step(opt)
        assert report.applied
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_trains(name: str) -> None:
    prec = Precision(name)
    losses = train(prec, steps=20)
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, (name, losses)
    assert prec.stats.steps == 20 and prec.stats.skipped_steps == 0


def test_prepare_sets_storage_and_keeps_fp32_islands(monkeypatch: pytest.MonkeyPatch) -> None:
    prec = Precision("bf16_master")
    model = prec.prepare(make_model())
    lin, norm = model[0], model[1]
    assert lin.weight.dtype == torch.bfloat16
    assert norm.weight.dtype == torch.float32 and norm.bias.dtype == torch.float32
    seen: list[torch.dtype] = []
    layer_norm = nn.functional.layer_norm

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = layer_norm(x, *args, **kwargs)  # type: ignore[arg-type]
        seen.append(x.dtype)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(nn.functional, "layer_norm", spy)
    x = torch.randn(4, 16)
    with prec.autocast():
        out = model(x)
    assert seen == [torch.float32, torch.float32], "the island computes in fp32 under autocast"
    assert out.dtype == torch.bfloat16
    # Without autocast, a bf16 model still runs: the island hands back bf16.
    out2 = model(x.bfloat16())
    assert out2.dtype == torch.bfloat16
    prec.prepare(model)  # idempotent
    assert lin.weight.dtype == torch.bfloat16


def test_prepare_fp32_policy_keeps_everything_fp32() -> None:
    model = Precision("amp_bf16").prepare(make_model())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_prepare_casts_back_to_fp32() -> None:
    model = make_model().to(torch.bfloat16)
    Precision("fp32").prepare(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _grad_step(
    prec: Precision, model: nn.Module, opt: torch.optim.Optimizer, inject: bool
) -> mixprec.StepReport:
    x, y = make_data(32)
    with prec.autocast():
        loss = loss_fn(model(x), y)
    prec.backward(loss)
    if inject:
        model[3].weight.grad[0, 0] = math.inf
    report = prec.step(opt)
    opt.zero_grad(set_to_none=True)
    return report


def test_fp16_injected_inf_skips_exactly_that_step() -> None:
    prec = Precision("amp_fp16")
    model = prec.prepare(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        assert _grad_step(prec, model, opt, inject=False).applied
    params_before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    scale_before = prec.loss_scale
    report = _grad_step(prec, model, opt, inject=True)
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
    assert _grad_step(prec, model, opt, inject=False).applied
    s = prec.stats
    assert (s.steps, s.applied_steps, s.skipped_steps, s.last_nonfinite_step) == (5, 4, 1, 3)
    assert s.consecutive_skips == 0


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
        _grad_step(prec, model, opt, inject=i in overflow_at)
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
    reports = [_grad_step(prec, model, opt, inject=i == 2) for i in range(5)]
    assert [r.applied for r in reports] == [True, True, False, True, True]
    assert {r.scale for r in reports} == {128.0}
    assert prec.loss_scale == 128.0


@pytest.mark.parametrize("name", ["fp32", "amp_bf16", "bf16_master"])
def test_unscaled_policies_still_skip_nonfinite(name: str) -> None:
    prec = Precision(name)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-2)
    _grad_step(prec, model, opt, inject=False)
    before = copy.deepcopy(model.state_dict())
    report = _grad_step(prec, model, opt, inject=True)
    assert not report.applied and report.scale is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


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
            _grad_step(prec, model, opt, inject=True)
    assert prec.stats.skipped_steps == 17


def test_consecutive_skips_limit_is_configurable() -> None:
    prec = Precision("amp_bf16", max_consecutive_skips=3)
    model = prec.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _grad_step(prec, model, opt, inject=True)
    _grad_step(prec, model, opt, inject=True)
    with pytest.raises(PrecisionError, match="3 consecutive steps"):
        _grad_step(prec, model, opt, inject=True)
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        Precision("fp32", max_consecutive_skips=0)


def test_state_dict_round_trip_continues_identically() -> None:
    def run(
        prec: Precision, model: nn.Module, opt: torch.optim.Optimizer, steps: range
    ) -> list[float | None]:
        out = []
        for i in steps:
            _grad_step(prec, model, opt, inject=i in (2, 5))
            out.append(prec.loss_scale)
        return out

    policy = Policy(compute_dtype=torch.float16, loss_scaling=LossScaling(growth_interval=2))
    a = Precision(policy)
    model_a = a.prepare(make_model())
    opt_a = torch.optim.SGD(model_a.parameters(), lr=1e-3)
    run(a, model_a, opt_a, range(4))
    saved = torch.load(_roundtrip(a.state_dict()), weights_only=True)
    model_b = copy.deepcopy(model_a)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-3)
    opt_b.load_state_dict(opt_a.state_dict())
    b = Precision(policy)
    b.prepare(model_b)
    b.load_state_dict(saved)
    assert b.stats.to_dict() == a.stats.to_dict()
    assert run(a, model_a, opt_a, range(4, 10)) == run(b, model_b, opt_b, range(4, 10))
    assert b.stats.to_dict() == a.stats.to_dict()
    with pytest.raises(ValueError, match="different policy"):
        Precision("amp_bf16").load_state_dict(saved)
    Precision("amp_bf16").load_state_dict(saved, strict=False)


def _roundtrip(state: dict[str, object]) -> object:
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_unsupported_compute_raises_instead_of_swapping(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = DeviceCaps(
        device_type="cpu",
        name="old cpu",
        bf16_supported=False,
        fp16_supported=True,
        bf16_fast=False,
        fp16_fast=False,
        bf16_reason="no bf16 here",
        fp16_reason="slow",
    )
    monkeypatch.setattr(
        importlib.import_module("mixprec.engine"), "device_caps", lambda device=None: caps
    )
    prec = Precision("amp_bf16", device="cpu")
    with pytest.raises(PrecisionError, match="old cpu cannot run: no bf16 here"):
        prec.autocast()
    with pytest.raises(PrecisionError, match="does not swap formats silently"):
        prec.prepare(make_model())


def test_fp16_on_cpu_without_fast_fp16_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = DeviceCaps(
        device_type="cpu",
        name="this cpu",
        bf16_supported=True,
        fp16_supported=True,
        bf16_fast=True,
        fp16_fast=False,
        bf16_reason="fast",
        fp16_reason="emulated fp16",
    )
    monkeypatch.setattr(
        importlib.import_module("mixprec.engine"), "device_caps", lambda device=None: caps
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        with pytest.raises(PerformanceWarning, match="emulated fp16"):
            Precision("amp_fp16").prepare(make_model())
    desc = Precision("amp_fp16", device="cpu").describe()
    assert desc["compute_supported"] and not desc["compute_fast"]


def test_backward_scales_the_loss() -> None:
    prec = Precision(Policy(compute_dtype=torch.float16, loss_scaling=LossScaling(init_scale=8.0)))
    w = nn.Parameter(torch.ones(3))
    prec.backward((w * 2).sum())
    assert torch.equal(w.grad, torch.full((3,), 16.0))
    assert repr(prec).startswith("Precision('custom'")


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
    _grad_step(prec, model, opt, inject=True)
    assert [e[0] for e in rec.events] == ["before", "after", "before", "after"]  # type: ignore[attr-defined]
    (step0, scaled0, gmax0) = rec.events[0][1]  # type: ignore[attr-defined, misc]
    assert step0 == 0 and not scaled0 and gmax0 < 100, "observers see true gradients"
    assert rec.events[3][1] == (1, False)  # type: ignore[attr-defined]
    prec.remove_observer(rec)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="before_step"):
        prec.add_observer(object())  # type: ignore[arg-type]
