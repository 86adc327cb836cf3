"""The multi-tensor step: one call per family and group, bitwise the per-parameter reference.

The reference is `kernels.adamw_step_` called on one parameter at a time with
scalars from `adamw_scalars` (what every path must reproduce). Checked here:
the native kernel's single call over a whole group, the portable path's
concatenation of small tensors, parameters at different step counts in one
call, the operator seen by the profiler and by ``torch._dynamo``, and no
per-parameter host read of the step counter.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from mixprec.formats import moment_format, resolve_master
from mixprec.optim import MASTER_KINDS, MOMENT_KINDS, AdamW, native, ops, step_batch
from mixprec.optim.kernels import StepFamily, step_
from mixprec.optim.rng import step_key
from mixprec.optim.rules import RULES
from mixprec.optim.step_batch import StepBatch

try:
    native.library()
    HAVE_NATIVE = True
except native.NativeUnavailableError:  # pragma: no cover - machines without a compiler
    HAVE_NATIVE = False

# Tiny, block-sized, tails, and one above the portable path's concatenation limit.
SHAPES = [(3,), (7, 11), (256,), (2, 512), (4096 + 13,), (step_batch.CONCAT_MAX_NUMEL + 256,)]
HYPER: dict[str, Any] = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) * 2).to(dtype).requires_grad_() for s in SHAPES]


def _grads(params: list[torch.Tensor], step: int, grad_dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    scale = 10.0 ** (step % 7 - 4)
    return [(torch.randn(p.shape, generator=gen) * scale).to(grad_dtype) for p in params]


def _reference_step(
    opt: AdamW, params: list[torch.Tensor], grads: list[torch.Tensor | None], maximize: bool
) -> None:
    """One step, one parameter at a time, through the pure function (the reference)."""
    group = opt.param_groups[0]
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        plan = opt._plans[p]
        state = opt._state_of(p)
        state["step"] += 1
        step = int(state["step"].item())
        scalars = plan.rule.scalar_tensor(plan.rule.read(group), step, p.device)
        shape = plan.moments.kernel_shape(p.shape)
        key = torch.zeros((), dtype=torch.int64)
        if plan.master.spec.uses_noise:
            key = step_key(state["rng_seed"], state["step"]) & 0xFFFFFFFF
        moments = [
            state[t.name].view(shape)
            if t.per_element
            else state[t.name].view(shape[0], -1)  # packed int4 codes: rows, half as wide
            if t.packed
            else state[t.name].view(-1)
            for t in plan.moments.spec.state_for(plan.rule.slots)
        ]
        with torch.no_grad():
            step_(
                p.detach().view(shape),
                g.view(shape),
                [state[k].view(shape) for k in plan.master.spec.state_keys],
                moments,
                scalars,
                key,
                family=StepFamily(plan.rule, plan.master, plan.moments, maximize),
            )


def _same(a: list[torch.Tensor], a_opt: AdamW, b: list[torch.Tensor], b_opt: AdamW) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(
            x.detach().view(-1).view(torch.uint8), y.detach().view(-1).view(torch.uint8)
        )
        assert a_opt.state[x].keys() == b_opt.state[y].keys()
        for key, value in a_opt.state[x].items():
            other = b_opt.state[y][key]
            assert torch.equal(
                value.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)
            ), key


CASES = [(m, mo) for m in MASTER_KINDS for mo in MOMENT_KINDS]


@pytest.mark.parametrize(
    "fused",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(not HAVE_NATIVE, reason="no native kernel")),
    ],
)
@pytest.mark.parametrize(("master", "moments"), CASES)
def test_one_call_per_group_is_bitwise_the_per_parameter_reference(
    master: str, moments: str, fused: bool
) -> None:
    dtype = torch.float32 if master == "none" else torch.bfloat16
    kw: dict[str, Any] = {**HYPER, "master": master, "moments": moments, "seed": 5}
    kw.update(min_int8_numel=0, maximize=True)
    ours_p, ref_p = _params(dtype), _params(dtype)
    ours = AdamW(ours_p, fused=fused, **kw)
    ref = AdamW(ref_p, fused=False, **kw)
    for step in range(5):
        grads: list[torch.Tensor | None] = list(
            _grads(ours_p, step, torch.float32 if step % 2 else dtype)
        )
        if step == 2:  # some parameters skip a step: counters differ inside one call
            grads[1] = grads[4] = None
        for p, q, g in zip(ours_p, ref_p, grads, strict=True):
            p.grad_dtype = q.grad_dtype = None
            p.grad = None if g is None else g.clone()
        ours.step()
        _reference_step(ref, ref_p, grads, maximize=True)
    assert ours.state[ours_p[1]]["step"].item() == 4 and ours.state[ours_p[0]]["step"].item() == 5
    _same(ours_p, ours, ref_p, ref)
    if fused:
        assert set(ours.kernel_backends().values()) == {"native"}


def test_portable_concatenation_covers_mixed_gradient_dtypes_and_odd_sizes() -> None:
    # Tensors with different gradient dtypes and step counts go to separate concatenations.
    dtype = torch.bfloat16
    kw: dict[str, Any] = {**HYPER, "master": "stochastic", "moments": "int8", "seed": 1}
    kw.update(min_int8_numel=0, block_size=4)
    shapes = [(4,), (8,), (3, 4), (16,), (2, 2)]
    ours_p = [torch.randn(s).to(dtype).requires_grad_() for s in shapes]
    ref_p = [p.detach().clone().requires_grad_() for p in ours_p]
    ours, ref = AdamW(ours_p, fused=False, **kw), AdamW(ref_p, fused=False, **kw)
    for step in range(4):
        grads: list[torch.Tensor | None] = [
            torch.randn(s).to(torch.float32 if i % 2 else dtype) for i, s in enumerate(shapes)
        ]
        if step == 1:
            grads[0] = None
        for p, q, g in zip(ours_p, ref_p, grads, strict=True):
            p.grad_dtype = q.grad_dtype = None
            p.grad = None if g is None else g.clone()
        ours.step()
        _reference_step(ref, ref_p, grads, maximize=False)
    _same(ours_p, ours, ref_p, ref)


@pytest.mark.skipif(not HAVE_NATIVE, reason="no native kernel")
def test_the_native_kernel_is_called_once_per_group_and_family(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    library = native.library()
    original = library._fn

    # the C function: (rule, master, moments, maximize, count, ...)
    def counting(*args: Any) -> int:
        calls.append(args[4])
        return int(original(*args))

    monkeypatch.setattr(library, "_fn", counting)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(10)]).to(torch.bfloat16)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], fused=True)
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert calls == [10, 10]


def test_no_host_read_of_step_counters_on_the_native_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAVE_NATIVE:
        pytest.skip("no native kernel")
    params = [torch.randn(64, dtype=torch.bfloat16, requires_grad=True) for _ in range(5)]
    opt = AdamW(params, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()

    def no_item(self: torch.Tensor) -> Any:
        raise AssertionError("a host read of a tensor during the step")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    monkeypatch.setattr(torch.Tensor, "tolist", no_item)
    opt.step()
    monkeypatch.undo()
    assert [int(opt.state[p]["step"].item()) for p in params] == [2] * 5


def test_the_profiler_sees_the_operator() -> None:
    params = [torch.randn(32, requires_grad=True) for _ in range(3)]
    opt = AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [e.name for e in prof.events()]
    assert names.count(ops.OP_NAME) == 1


def test_dynamo_traces_the_step_without_a_graph_break() -> None:
    torch._dynamo.reset()
    params = [torch.randn(32, dtype=torch.bfloat16, requires_grad=True) for _ in range(5)]
    opt = AdamW(params, master="stochastic", seed=0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state exists: the traced step is a steady one
    explanation = torch._dynamo.explain(opt.step)()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.compile
def test_compiled_step_equals_the_eager_step() -> None:
    torch._dynamo.reset()
    make = lambda: [torch.randn(s).to(torch.bfloat16).requires_grad_() for s in ((8,), (3, 5))]  # noqa: E731
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    b = make()
    opt_a, opt_b = AdamW(a, seed=0, master="kahan"), AdamW(b, seed=0, master="kahan")
    step_b = torch.compile(opt_b.step)
    for i in range(3):
        for p, q in zip(a, b, strict=True):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
            q.grad = p.grad.clone()
        opt_a.step()
        step_b()
    _same(a, opt_a, b, opt_b)


def test_deepcopy_of_an_optimizer_steps_its_own_state() -> None:
    p = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones_like(p)
    opt = AdamW([p])
    opt.step()
    twin_p = copy.deepcopy(p)
    twin = AdamW([twin_p])
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_p.grad = torch.ones_like(twin_p)
    twin.step()
    assert opt.state[p]["step"].item() == 1 and twin.state[twin_p]["step"].item() == 2


def test_the_operator_refuses_what_it_cannot_read() -> None:
    if not HAVE_NATIVE:
        pytest.skip("no native kernel")
    lib = native.library()
    p = torch.zeros(8)
    g = torch.zeros(16)[::2]  # not contiguous
    m, v = torch.zeros(8), torch.zeros(8)
    step = torch.zeros((), dtype=torch.float64)
    kernel = step_batch.kernel_for(
        "adamw", "none", "fp32", maximize=False, block_size=1, mode="native"
    )
    with pytest.raises(ValueError, match="contiguous CPU"):
        lib.step_many(
            StepBatch(
                kernel, 1, params=[p], grads=[g], master_state=[], moment_state=[m, v],
                steps=[step], seeds=[], offsets=[0],
            ),
            (1e-3, 0.9, 0.999, 1e-8, 0.0),
        )  # fmt: skip
    with pytest.raises(ValueError, match="float64"):
        lib.step_many(
            StepBatch(
                kernel, 1, params=[p], grads=[p.clone()], master_state=[], moment_state=[m, v],
                steps=[step.float()], seeds=[], offsets=[0],
            ),
            (1e-3, 0.9, 0.999, 1e-8, 0.0),
        )  # fmt: skip
    assert step.item() == 0 and torch.equal(p, torch.zeros(8))  # nothing written


def test_family_of_names_round_trips() -> None:
    family = step_batch.family_of("adamw", "exact", "int8", maximize=True, block_size=64)
    assert family == StepFamily(
        RULES["adamw"],
        resolve_master("exact", torch.bfloat16),
        moment_format("int8", block_size=64),
        True,
    )


@pytest.mark.skipif(not HAVE_NATIVE, reason="no native kernel")
def test_a_resized_parameter_is_refused_not_stepped_with_its_old_state() -> None:
    # Found by review: `p.data = smaller` was stepped with the old, larger state.
    p = torch.nn.Parameter(torch.randn(100, dtype=torch.bfloat16))
    opt = AdamW([p], fused=True)
    p.grad = torch.randn_like(p)
    opt.step()
    p.data = torch.zeros(50, dtype=torch.bfloat16)
    p.grad = torch.ones_like(p)
    step_before = opt.state[p]["step"].clone()
    with pytest.raises(ValueError, match="size does not match its parameter"):
        opt.step()
    assert torch.equal(opt.state[p]["step"], step_before)  # nothing written
    assert torch.equal(p.detach(), torch.zeros(50, dtype=torch.bfloat16))


@pytest.mark.compile
def test_compiled_steps_are_not_taken_for_edits_by_the_eager_views() -> None:
    # Found by review: after a compiled step, master_weights() / state_dict() saw the
    # step's own writes as in-place edits and reset the masters (precision lost).
    torch._dynamo.reset()
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    q = torch.nn.Parameter(p.detach().clone())
    eager, compiled = AdamW([p], lr=1e-2), AdamW([q], lr=1e-2)
    step = torch.compile(compiled.step)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
        eager.step()
        step()
        assert torch.equal(eager.master_weights()[0], compiled.master_weights()[0])
    _same([p], eager, [q], compiled)


@pytest.mark.skipif(not HAVE_NATIVE, reason="no native kernel")
def test_a_gradient_of_the_wrong_size_is_refused() -> None:
    # Found by review: `p.grad.data = smaller` was read past its end.
    p = torch.nn.Parameter(torch.randn(100))
    opt = AdamW([p], fused=True)
    p.grad = torch.randn(100)
    p.grad.data = torch.randn(7)
    with pytest.raises(ValueError, match="size does not match its parameter"):
        opt.step()


@pytest.mark.skipif(not HAVE_NATIVE, reason="no native kernel")
@pytest.mark.parametrize("bad", [-1.0, float("nan"), 2.5])
def test_a_step_counter_that_is_not_a_count_is_refused(bad: float) -> None:
    # Found by review: a negative or NaN step wrote NaN into the parameters.
    p = torch.nn.Parameter(torch.randn(64))
    opt = AdamW([p], fused=True)
    p.grad = torch.randn(64)
    opt.step()
    opt.state[p]["step"].fill_(bad)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="step counter"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("fused", [True, False])
def test_state_follows_a_layout_change_after_it_was_made(fused: bool) -> None:
    # Found by review: Module.to(memory_format=...) after the first step paired the
    # state with the wrong elements (0.031 off where torch's AdamW is 3e-8 off).
    def run(convert: bool) -> torch.Tensor:
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(8, 16, 3)
        opt = AdamW(conv.parameters(), lr=1e-2, fused=fused)
        for step in range(3):
            if convert and step == 1:
                conv.to(memory_format=torch.channels_last)
            if convert and step == 2:
                conv.to(memory_format=torch.contiguous_format)
            torch.manual_seed(10 + step)
            conv(torch.randn(2, 8, 6, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([w.reshape(-1) for w in opt.master_weights()])

    # Convolution results differ by rounding between layouts; state mixed up is 1e-2.
    torch.testing.assert_close(run(True), run(False), atol=1e-6, rtol=0)


def test_fp16_gradients_on_one_fp32_parameter_step_under_fused_true() -> None:
    # Found by review: tracing the parameter's view also traced its fp16 .grad.
    p = torch.nn.Parameter(torch.randn(8192))
    ref = torch.nn.Parameter(p.detach().clone())
    opt, ref_opt = AdamW([p], fused=True), AdamW([ref], fused=False)
    for q in (p, ref):
        q.grad_dtype = None
        q.grad = torch.full((8192,), 0.25, dtype=torch.float16)
    opt.step()
    ref_opt.step()
    assert torch.equal(p, ref)


def test_the_operator_refuses_an_unknown_kernel_mode_and_short_lists() -> None:
    p, g = torch.zeros(4), torch.zeros(4)
    m, v, step = torch.zeros(4), torch.zeros(4), torch.zeros((), dtype=torch.float64)
    args = (
        [p],
        [g],
        [],
        [m, v],
        [step],
        [],
        [0],
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.0,
        "adamw",
        "none",
        "fp32",
    )
    with pytest.raises(ValueError, match="kernel_mode 'bogus'"):
        torch.ops.mixprec.step_(*args, False, 1, "bogus")
    with pytest.raises(ValueError, match="need as many grads"):
        torch.ops.mixprec.step_([p], [], *args[2:], False, 1, "eager")
