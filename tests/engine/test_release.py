"""Gradient release (`Policy.release_gradients`, `mixprec.engine.release`): the same
training as the ordinary step, a non-finite gradient never applied, loss scaling as
GradScaler does it, and what it refuses."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import mixprec
from mixprec import LossScaling, Policy, Precision, PrecisionError

STEPS = 4
#: The ordinary step reports torch's total norm, whose per-tensor norms of bf16 gradients
#: are rounded to bf16; release measures each gradient in fp32.
NORM_REL = 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    # A 64x128 weight (8192 elements) has int8 moments under bf16_lean; the norm is an
    # fp32 island; the head is small (fp32 moments).
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 8))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)


def _loss(prec: Precision, model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    with prec.autocast():
        out = model(x)
    return (out.float() - y).pow(2).mean()


def _released(name: str, **changes: object) -> Policy:
    return mixprec.preset(name).replace(release_gradients=True, **changes)


def _completion_order(prec: Precision, model: nn.Module) -> list[int]:
    """The indices (in `model.parameters()` order) of the parameters in the order one
    backward completes their gradients."""
    params = list(model.parameters())
    order: list[int] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
        for i, p in enumerate(params)
    ]
    _loss(prec, model, 0).backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return order


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name, value in sa[key].items():
            assert torch.equal(value, sb[key][name]), (key, name)


@pytest.mark.parametrize("name", ["bf16_lean", "bf16_master"])
def test_release_trains_bitwise_as_the_ordinary_step(name: str) -> None:
    ordinary, released = Precision(name), Precision(_released(name))
    m1, m2 = ordinary.prepare(_model()), released.prepare(_model())
    o1, o2 = ordinary.optimizer(m1, lr=1e-2), released.optimizer(m2, lr=1e-2)
    for step in range(STEPS):
        ordinary.backward(_loss(ordinary, m1, step))
        r1 = ordinary.step(o1)
        o1.zero_grad(set_to_none=True)
        released.backward(_loss(released, m2, step))
        assert all(p.grad is None for p in m2.parameters())  # freed in backward
        r2 = released.step(o2)
        assert r1.applied and r2.applied
        assert (r2.released_params, r2.withheld_params) == (4 + 2, 0)
        assert r2.grad_norm == pytest.approx(r1.grad_norm, rel=NORM_REL)
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
            assert torch.equal(p, q)
    _same_state(o1, o2)
    assert "gradients released" in released.policy.describe()


def test_gradients_without_a_hook_are_taken_at_the_step() -> None:
    """An optimizer `prec.step` registers (its first gradients came before its hooks)
    and a parameter made trainable after the hooks went on: their gradients are taken
    (checked, stepped) at the step, and released in backward from then on."""
    ordinary, released = Precision("bf16_lean"), Precision(_released("bf16_lean"))
    m1, m2 = ordinary.prepare(_model()), released.prepare(_model())
    for m in (m1, m2):
        m[3].weight.requires_grad_(False)
    o1 = mixprec.optim.AdamW(m1.parameters(), lr=1e-2, master="remainder8", moments="int8")
    o2 = mixprec.optim.AdamW(m2.parameters(), lr=1e-2, master="remainder8", moments="int8")
    for step in range(STEPS):
        if step == 2:
            for m in (m1, m2):
                m[3].weight.requires_grad_(True)
        ordinary.backward(_loss(ordinary, m1, step))
        ordinary.step(o1)
        o1.zero_grad(set_to_none=True)
        released.backward(_loss(released, m2, step))
        held = sum(p.grad is not None for p in m2.parameters())
        report = released.step(o2)
        assert held == {0: 5, 2: 1}.get(step, 0)  # all at first, then the unfrozen one
        assert report.applied and report.released_params == (5 if step < 2 else 6)
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
            assert torch.equal(p, q)
    _same_state(o1, o2)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("bad_step", [0, 2])
@pytest.mark.parametrize("position", range(6))
def test_a_nonfinite_gradient_never_reaches_a_weight(
    position: int, bad_step: int, value: float
) -> None:
    """The gradient completed `position`-th at step `bad_step` is inf/NaN: the parameters
    completed before it keep their update, it and every later one are not stepped, and
    the run continues as the ordinary step given only those earlier gradients."""
    ref_prec, prec = Precision("bf16_lean"), Precision(_released("bf16_lean"))
    reference, model = ref_prec.prepare(_model()), prec.prepare(_model())
    order = _completion_order(ref_prec, reference)
    ref_opt, opt = ref_prec.optimizer(reference, lr=1e-2), prec.optimizer(model, lr=1e-2)
    ref_params, params = list(reference.parameters()), list(model.parameters())
    bad = order[position]
    inject = {"on": False}
    params[bad].register_hook(lambda g: torch.full_like(g, value) if inject["on"] else g)
    for step in range(STEPS):
        inject["on"] = step == bad_step
        prec.backward(_loss(prec, model, step))
        report = prec.step(opt)
        ref_prec.backward(_loss(ref_prec, reference, step))
        if step == bad_step:  # the expected: only the gradients completed before it
            for i in order[position:]:
                ref_params[i].grad = None
        ref_prec.step(ref_opt)
        ref_opt.zero_grad(set_to_none=True)
        if step == bad_step:
            assert not report.applied
            assert (report.released_params, report.withheld_params) == (position, 6 - position)
            assert report.nonfinite_grads >= params[bad].numel()
            assert not math.isfinite(report.grad_norm)
        else:
            assert report.applied and report.withheld_params == 0
        for p, q in zip(ref_params, params, strict=True):
            assert bool(torch.isfinite(q).all())
            assert torch.equal(p, q)
    _same_state(ref_opt, opt)
    assert prec.stats.skipped_steps == 1


def test_a_nonfinite_loss_steps_nothing() -> None:
    prec = Precision(_released("bf16_master"))
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    prec.backward(_loss(prec, model, 0) * math.inf)
    report = prec.step(opt)
    assert (report.applied, report.released_params, report.withheld_params) == (False, 0, 6)
    assert report.loss_finite is False
    for p, q in zip(before, model.parameters(), strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- loss scaling


def _amp_policy(**changes: object) -> Policy:
    scaling = LossScaling(init_scale=2.0**10, growth_interval=2)
    return _released("amp_fp16", loss_scaling=scaling, **changes)


def _inf_injector(params: list[torch.Tensor], at: int | None) -> dict[str, bool]:
    """A switch (``["on"]``) that makes the gradient of ``params[at]`` all inf."""
    inject = {"on": False}
    if at is not None:
        params[at].register_hook(lambda g: torch.full_like(g, math.inf) if inject["on"] else g)
    return inject


def _grad_scaler_run(
    inject_at: int | None, bad_step: int
) -> Iterator[tuple[list[torch.Tensor], float]]:
    """The hand-written loop: GradScaler over mixprec's AdamW on fp32 parameters, fp16
    autocast; yields the parameters and the scale after each step."""
    model = _model()
    opt = mixprec.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    params = list(model.parameters())
    inject = _inf_injector(params, inject_at)
    for step in range(STEPS):
        inject["on"] = step == bad_step
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        yield [p.detach().clone() for p in params], float(scaler.get_scale())


def _released_run(
    inject_at: int | None, bad_step: int
) -> Iterator[tuple[list[torch.Tensor], float, mixprec.StepReport]]:
    prec = Precision(_amp_policy())
    model = prec.prepare(_model())
    opt = prec.optimizer(model, lr=1e-2)
    params = list(model.parameters())
    inject = _inf_injector(params, inject_at)
    for step in range(STEPS):
        inject["on"] = step == bad_step
        prec.backward(_loss(prec, model, step))
        report = prec.step(opt)
        yield [p.detach().clone() for p in params], float(prec.scaler.get_scale()), report


def _order_fp16() -> list[int]:
    prec = Precision("amp_fp16")
    return _completion_order(prec, prec.prepare(_model()))


@pytest.mark.parametrize("overflow", [None, "first"])
def test_amp_fp16_release_is_the_grad_scaler_loop_step_by_step(overflow: str | None) -> None:
    """Bitwise, with the scale growing (growth_interval 2) and, with an overflow seen at
    the first parameter the backward completes, the same skip and the same backoff."""
    inject_at = None if overflow is None else _order_fp16()[0]
    expected = _grad_scaler_run(inject_at, bad_step=1)
    for step, ((want, want_scale), (got, scale, report)) in enumerate(
        zip(expected, _released_run(inject_at, bad_step=1), strict=True)
    ):
        assert scale == want_scale, step
        for p, q in zip(want, got, strict=True):
            assert torch.equal(p, q), step
        skipped = overflow is not None and step == 1
        assert report.applied is not skipped
        assert report.released_params == (0 if skipped else 6)
    # The case exercises what it claims: the scale grows, and backs off at the overflow.
    scales = [s for _, s in _grad_scaler_run(inject_at, bad_step=1)]
    assert any(b > a for a, b in itertools.pairwise(scales))
    assert (scales[1] == scales[0] / 2) == (overflow is not None)


def test_amp_fp16_release_differs_from_grad_scaler_past_the_first_parameter() -> None:
    """The documented difference: an overflow seen at the last parameter the backward
    completes. GradScaler skips every parameter; release has stepped the earlier ones
    (with finite gradients) and withholds the rest; both back the scale off alike."""
    order = _order_fp16()
    last = order[-1]
    expected = list(_grad_scaler_run(last, bad_step=1))
    got = list(_released_run(last, bad_step=1))
    (want0, _), (want1, want_scale1) = expected[0], expected[1]
    got1, scale1, report = got[1]
    assert scale1 == want_scale1 == expected[0][1] / 2  # the same backoff
    assert (report.applied, report.released_params, report.withheld_params) == (False, 5, 1)
    for i in range(6):
        if i == last:  # withheld by both: unchanged since step 0
            assert torch.equal(got1[i], want0[i]) and torch.equal(want1[i], want0[i])
        else:  # stepped by release only
            assert torch.equal(want1[i], want0[i]) and not torch.equal(got1[i], want0[i])
            assert bool(torch.isfinite(got1[i]).all())


# ------------------------------------------------------------------ refusals


def _ready(name: str = "bf16_lean") -> tuple[Precision, nn.Module, torch.optim.Optimizer]:
    prec = Precision(_released(name))
    model = prec.prepare(_model())
    return prec, model, prec.optimizer(model, lr=1e-2)


def test_clipping_is_refused_with_the_reason_and_an_alternative() -> None:
    prec, model, _ = _ready()
    prec.backward(_loss(prec, model, 0))
    with pytest.raises(
        PrecisionError, match=r"clip_grad_norm_ is refused .*global norm.*bf16_lean"
    ):
        prec.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(PrecisionError, match="unscale_ is refused"):
        prec.unscale_(prec.optimizer(model))


def test_accumulation_is_refused() -> None:
    prec, model, opt = _ready()
    prec.backward(_loss(prec, model, 0))
    with pytest.raises(PrecisionError, match=r"second prec\.backward before prec\.step"):
        prec.backward(_loss(prec, model, 1))
    prec.step(opt)
    prec.backward(_loss(prec, model, 1))  # one backward per step is fine
    with pytest.raises(ValueError, match="grad_accum_dtype=None"):
        _released("bf16_lean", grad_accum_dtype=torch.float32)


def test_a_backward_outside_prec_backward_is_refused_and_leaves_no_gradient() -> None:
    """The refused backward's gradient is not kept for the next step to add to its own:
    that step is bitwise one that never saw it."""
    prec, model, opt = _ready()
    with pytest.raises(PrecisionError, match=r"outside prec.backward"):
        _loss(prec, model, 0).backward()
    assert all(p.grad is None for p in model.parameters())
    prec.backward(_loss(prec, model, 1))
    prec.step(opt)
    ref_prec, ref_model, ref_opt = _ready()
    ref_prec.backward(_loss(ref_prec, ref_model, 1))
    ref_prec.step(ref_opt)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (
            lambda prec, model: prec.optimizer(model, optimizer=torch.optim.SGD, lr=0.1),
            "mixprec.optim.mastered.Mastered",
        ),
        (
            lambda prec, model: prec.register(torch.optim.AdamW(model.parameters(), lr=0.1)),
            "torch.optim.adamw.AdamW",  # not to be read as mixprec's AdamW
        ),
    ],
    ids=["mastered", "torch"],
)
def test_other_optimizers_are_refused(
    build: Callable[[Precision, nn.Module], object], name: str
) -> None:
    prec = Precision(_released("fp32"))
    model = prec.prepare(_model())
    with pytest.raises(
        PrecisionError,
        match=rf"mixprec's own optimizers .*AdamW, Adam, SGD, Lion\); {re.escape(name)} cannot",
    ):
        build(prec, model)


def test_ddp_fsdp2_and_several_ranks_are_refused(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the boundaries: a DDP model at prepare, DTensor parameters (FSDP2's) when the
    optimizer is built, a process group of more than one rank at prepare."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/rendezvous"
    )
    try:
        prec = Precision(_released("fp32"))
        with pytest.raises(PrecisionError, match="DDP or FSDP2"):
            prec.prepare(nn.parallel.DistributedDataParallel(_model()))
        mesh = init_device_mesh("cpu", (1,))
        sharded = nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
        with pytest.raises(PrecisionError, match="DDP or FSDP2"):
            prec.optimizer([sharded], lr=0.1)
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        with pytest.raises(PrecisionError, match="DDP or FSDP2"):
            prec.prepare(_model())
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_the_policy_field_reads_from_configs_and_shows() -> None:
    policy = Policy.from_dict({"preset": "bf16_lean", "release_gradients": True})
    assert policy.release_gradients and policy.to_dict()["release_gradients"] is True
    assert Policy.from_dict(policy.to_dict()) == policy
    with pytest.raises(ValueError, match="release_gradients must be true or false"):
        Policy.from_dict({"release_gradients": "yes"})
    with pytest.raises(TypeError, match="release_gradients must be True or False"):
        Policy(release_gradients=1)  # type: ignore[arg-type]
    assert "gradients: released" in Precision(policy).plan.describe()
