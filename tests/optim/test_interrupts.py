"""Ctrl-C during a step: the next steps continue exactly as if it had not happened.

Python raises a Ctrl-C's KeyboardInterrupt between operations, so it can land anywhere
in `AdamW.step`'s Python, including after the native kernel wrote the parameters and
before the optimizer recorded that the write was its own: the next step then took it
for an in-place edit and reset the masters to the 16-bit values. Here a SIGINT is
delivered at every line a step executes (`sys.settrace`, Python's own handler), the run
continues, and every parameter and state tensor must equal, bit for bit, an
uninterrupted run's after as many steps as that parameter's counter says; an in-place
edit made after the interrupt must be followed as any edit is.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import pytest
import torch

from mixprec.optim import AdamW

# The tracer's KeyboardInterrupt also lands in generator expressions, which Python then
# reports as "exception ignored" when it closes them: expected here.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SHAPES = [(300,), (7,)]
STEPS = 4


def _build(master: str, fused: bool) -> tuple[list[torch.nn.Parameter], AdamW]:
    gen = torch.Generator().manual_seed(8)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in SHAPES]
    groups = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.2}]
    return params, AdamW(groups, lr=1e-2, master=master, fused=fused, seed=4)


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()


def _snapshot(params: list[torch.nn.Parameter], opt: AdamW) -> list[dict[str, torch.Tensor]]:
    return [
        {"param": p.detach().clone(), **{k: v.clone() for k, v in opt.state.get(p, {}).items()}}
        for p in params
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def _own_handler(signum: int, frame: FrameType | None) -> None:
    """A program's own SIGINT handler that raises (`ctrl_c.held` holds nothing then)."""
    raise KeyboardInterrupt("the program's own handler")


def _interrupted_run(
    master: str, fused: bool, at_step: int, point: int, handler: Any = None
) -> tuple[bool, list[torch.nn.Parameter], AdamW]:
    """Steps to `at_step`, interrupts that step at its `point`-th traced line, then steps
    on (re-running the interrupted step where its counter did not move). `handler`:
    the SIGINT handler installed (Python's own by default)."""
    params, opt = _build(master, fused)
    for step in range(at_step):
        _grads(params, step)
        opt.step()
    _grads(params, at_step)
    seen = 0
    fired = False

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal seen, fired
        if event in ("line", "call"):
            seen += 1
            if seen == point:
                fired = True
                signal.raise_signal(signal.SIGINT)  # a Ctrl-C, delivered at the next line
        return tracer

    grad_mode = torch.is_grad_enabled()
    previous = signal.signal(signal.SIGINT, handler or signal.default_int_handler)
    try:
        try:
            sys.settrace(tracer)
            opt.step()
        finally:
            sys.settrace(None)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)
        # A Ctrl-C at the entry of `torch.no_grad`'s __exit__ (torch's decorator on
        # every optimizer's step) leaves grad mode off: torch's matter, not the state's.
        torch.set_grad_enabled(grad_mode)
    return fired, params, opt


def _counter(opt: AdamW, p: torch.nn.Parameter) -> int:
    st = opt.state.get(p)
    return int(st["step"]) if st else 0


def _carry_on(params: list[torch.nn.Parameter], opt: AdamW, at_step: int) -> None:
    """After an interrupted step `at_step`: re-run it for the parameters it did not
    reach, then the rest of the run."""
    for step in range(at_step, STEPS):
        _grads(params, step)
        for p in params:
            if _counter(opt, p) != step:
                p.grad = None
        if any(p.grad is not None for p in params):
            opt.step()


@pytest.mark.slow
@pytest.mark.parametrize("master", ["exact", "kahan"])
@pytest.mark.parametrize("at_step", [0, 2])  # the full path; a replayed step
def test_an_interrupt_anywhere_in_a_native_step_loses_nothing(master: str, at_step: int) -> None:
    ref_params, ref = _build(master, fused=True)
    snapshots = [_snapshot(ref_params, ref)]
    for step in range(STEPS):
        _grads(ref_params, step)
        ref.step()
        snapshots.append(_snapshot(ref_params, ref))

    point, checked = 1, 0
    while True:
        fired, params, opt = _interrupted_run(master, True, at_step, point)
        if not fired:
            break
        # Each parameter was stepped by its group's native call, or not at all.
        for i, p in enumerate(params):
            assert _counter(opt, p) in (at_step, at_step + 1), (point, i)
        _carry_on(params, opt, at_step)
        for i, p in enumerate(params):
            expected = snapshots[_counter(opt, p)][i]
            got = {"param": p.detach(), **opt.state[p]}
            bad = [k for k, v in expected.items() if not _same(got[k], v)]
            assert not bad, f"interrupt at line {point}: parameter {i} differs in {bad}"
        checked += 1
        point += 1
    assert checked > 50  # the step ran through that many traced lines


def _edited_reference(master: str, edit_at: int) -> dict[str, torch.Tensor]:
    """Parameter 0's end state when it is halved in place after `edit_at` steps."""
    params, opt = _build(master, fused=True)
    for step in range(STEPS):
        if step == edit_at:
            with torch.no_grad():
                params[0].mul_(0.5)
        _grads(params, step)
        opt.step()
    return {
        "param": params[0].detach().clone(),
        **{k: v.clone() for k, v in opt.state[params[0]].items()},
    }


@pytest.mark.slow
@pytest.mark.parametrize("master", ["exact", "fp32", "kahan", "remainder8"])
@pytest.mark.parametrize("at_step", [1, 2])  # the full path after a step; a replayed step
@pytest.mark.parametrize("handler", [None, _own_handler], ids=["python", "own"])
def test_an_edit_after_an_interrupted_step_is_followed(
    master: str, at_step: int, handler: Any
) -> None:
    """After an interrupt the version counters cannot tell the step's own write from an
    edit made after it: an edit (here ``p.mul_(0.5)``) was taken for the step's write and
    not followed (the fp32 master reverted it, exact and remainder8 decoded to NaN). With
    a program's own handler that raises (found by review), an interrupt between the
    native write and its version bump made an edit after it look like the bump: the edit
    was undone."""
    references = {k: _edited_reference(master, k) for k in (at_step, at_step + 1)}
    point, checked = 1, 0
    while True:
        fired, params, opt = _interrupted_run(master, True, at_step, point, handler)
        if not fired:
            break
        edit_at = _counter(opt, params[0])
        with torch.no_grad():
            params[0].mul_(0.5)
        _carry_on(params, opt, at_step)
        got = {"param": params[0].detach(), **opt.state[params[0]]}
        expected = references[edit_at]
        bad = [k for k, v in expected.items() if not _same(got[k], v)]
        assert not bad, f"interrupt at line {point}: parameter 0 differs in {bad}"
        checked += 1
        point += 1
    assert checked > 50
