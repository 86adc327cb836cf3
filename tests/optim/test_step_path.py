"""The one step path: what a steady step runs, what the kernel checks, the one edit rule."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import FrameType

import pytest
import torch

import mixprec.optim
from mixprec.optim import AdamW, native
from mixprec.optim.step_batch import StepBatch, kernel_for

try:
    native.library()
    HAVE_NATIVE = True
except native.NativeUnavailableError:  # pragma: no cover - machines without a compiler
    HAVE_NATIVE = False

needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="no native kernel")

#: Issue 32: the optimizer's share of a steady step's trace.
MAX_STEADY_FUNCTIONS = 6
MAX_STEADY_FILES = 3


def _optim_frames(fn: object) -> set[str]:
    """``file:function`` of every Python frame under mixprec/optim that `fn()` runs."""
    root = str(Path(mixprec.optim.__file__).parent) + "/"
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            name = frame.f_code.co_filename[len(root) :]
            seen.add(f"{name}:{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        fn()  # type: ignore[operator]
    finally:
        sys.setprofile(None)
    return seen


def _model_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(64, 32), (64,), (32, 64), (32,), (16,)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes[:4]]
    return [*params, torch.nn.Parameter(torch.randn(shapes[4]))]  # an fp32 island


def _fill(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@needs_native
def test_a_steady_step_runs_a_handful_of_optimizer_functions() -> None:
    """A steady native step ran 23 functions in 7 optimizer files (replay checks, write
    markers, Ctrl-C holds); one gathered batch per family needs a few."""
    params = _model_params()
    opt = AdamW(params, master="exact", fused=True)
    for seed in range(3):
        _fill(params, seed)
        opt.step()
    _fill(params, 3)
    frames = _optim_frames(opt.step)
    files = {name.split(":", 1)[0] for name in frames}
    assert len(frames) <= MAX_STEADY_FUNCTIONS, sorted(frames)
    assert len(files) <= MAX_STEADY_FILES, sorted(files)
    assert not any("<listcomp>" in f or "<genexpr>" in f for f in frames), sorted(frames)


@needs_native
def test_the_kernel_refuses_hyperparameters_out_of_range() -> None:
    """Bounds are checked in C (return code 5), so no per-step Python check is needed."""
    p = torch.randn(64).bfloat16()
    grad = torch.randn(64).bfloat16()
    remainder = [torch.zeros(64, dtype=torch.int8), torch.zeros(64, dtype=torch.int8)]
    moments = [torch.zeros(64), torch.zeros(64)]
    step = torch.zeros((), dtype=torch.float64)
    before = p.clone()
    kernel = kernel_for("adamw", "exact", "fp32", maximize=False, block_size=256, mode="native")
    for hyper in [
        (float("nan"), 0.9, 0.999, 1e-8, 0.0),
        (1e-3, 1.0, 0.999, 1e-8, 0.0),
        (1e-3, 0.9, 0.999, 0.0, 0.0),
        (1e-3, 0.9, 0.999, 1e-8, float("inf")),
    ]:
        with pytest.raises(ValueError, match="code 5"):
            native.library().step_many(
                StepBatch(
                    kernel,
                    256,
                    params=[p],
                    grads=[grad],
                    master_state=remainder,
                    moment_state=moments,
                    steps=[step],
                    seeds=[],
                    offsets=[0],
                ),
                hyper,
            )
    assert torch.equal(p, before) and float(step) == 0.0


@needs_native
def test_a_row_without_a_gradient_is_skipped_by_the_kernel() -> None:
    """A gradient pointer of 0 skips its row: the parameter and its counter stay."""
    library = native.library()
    params = [torch.randn(64).bfloat16() for _ in range(2)]
    grads = [torch.randn(64).bfloat16() for _ in range(2)]
    state = [torch.zeros(64, dtype=torch.int8) for _ in range(4)]
    moments = [torch.zeros(64) for _ in range(4)]
    steps = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
    kernel = kernel_for("adamw", "exact", "fp32", maximize=False, block_size=256, mode="native")
    table = library.prepare(
        StepBatch(
            kernel,
            256,
            params=params,
            grads=grads,
            master_state=state,
            moment_state=moments,
            steps=steps,
            seeds=[],
            offsets=[0, 0],
        )
    )
    table.table[table.grads.start] = 0  # the first parameter has no gradient this step
    before = [p.clone() for p in params]
    table.run((1e-2, 0.9, 0.999, 1e-8, 0.0))
    assert torch.equal(params[0], before[0]) and float(steps[0]) == 0.0
    assert not torch.equal(params[1], before[1]) and float(steps[1]) == 1.0


@pytest.mark.parametrize("fused", [True, False])
def test_weights_written_after_the_optimizer_state_was_loaded_reset_the_masters(
    fused: bool,
) -> None:
    """One rule, no heuristics: a parameter whose version moved since the optimizer last
    wrote it has its master reset from it, also right after `load_state_dict` (the old
    rule kept the loaded masters for one write; a resume loads the model first)."""
    params = _model_params()[:2]
    opt = AdamW(params, master="exact", fused=fused)
    for seed in range(2):
        _fill(params, seed)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    masters = opt.master_weights()
    assert not all(torch.equal(m, w.float()) for m, w in zip(masters, weights, strict=True))
    fresh = [torch.nn.Parameter(torch.zeros_like(w)) for w in weights]
    model_first = AdamW(fresh, master="exact", fused=fused)
    with torch.no_grad():
        for p, w in zip(fresh, weights, strict=True):
            p.copy_(w)
    model_first.load_state_dict(saved)  # the documented order: masters kept bitwise
    for a, b in zip(model_first.master_weights(), masters, strict=True):
        assert torch.equal(a, b)
    other = [torch.nn.Parameter(torch.zeros_like(w)) for w in weights]
    optimizer_first = AdamW(other, master="exact", fused=fused)
    optimizer_first.load_state_dict(saved)
    with torch.no_grad():
        for p, w in zip(other, weights, strict=True):
            p.copy_(w)  # a write after the load: an edit, followed
    for a, w in zip(optimizer_first.master_weights(), weights, strict=True):
        assert torch.equal(a, w.float())


@pytest.mark.parametrize("master", ["exact", "remainder8"])
def test_storage_replaced_between_steps_resets_the_master(master: str) -> None:
    """``torch.nn.utils.vector_to_parameters`` (``p.data = ...``) gives a parameter new
    storage without moving its version counter; its master follows the new values (a
    remainder kept from the old value decoded NaN over zeros, found by review)."""
    params = _model_params()[:4]
    opt = AdamW(params, master=master)
    for seed in range(3):
        _fill(params, seed)
        opt.step()
    vector = torch.nn.utils.parameters_to_vector(params)
    torch.nn.utils.vector_to_parameters(torch.zeros_like(vector), params)
    for m in opt.master_weights():
        assert torch.equal(m, torch.zeros_like(m))
    _fill(params, 3)
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in params)
