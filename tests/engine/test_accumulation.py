"""Gradient accumulation over micro-batches under 16-bit storage (issue 30, item 2).

The reference is the float64 sum of each micro-batch's gradient, taken with
``torch.autograd.grad`` on the same prepared model (the exact values autograd
hands to ``.grad``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tolerances as tol
from mixprec import LossScaling, Policy, Precision, PrecisionError, preset

from .helpers import loss_fn, make_model

BF16_MASTER = preset("bf16_master")
FP32_ACCUM = BF16_MASTER.replace(grad_accum_dtype=torch.float32)

pytestmark = pytest.mark.usefixtures("quiet_expected_warnings")


def batches(n: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def reference(
    prec: Precision, model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The float64 sum of the micro-batches' gradients, per parameter."""
    params = list(model.parameters())
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for x, y in data:
        with prec.autocast():
            loss = loss_fn(model(x), y)
        for t, g in zip(total, torch.autograd.grad(loss, params), strict=True):
            t += g.double()
    return total


def accumulate(
    prec: Precision, model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    for x, y in data:
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)


def errors(model: nn.Module, ref: list[torch.Tensor]) -> tuple[float, float, float]:
    """Over the 16-bit parameters: the relative error of .grad against the float64 sum,
    that of the float64 sum rounded once to bf16 (the floor), and the share of elements
    equal to that rounded sum."""
    pairs = [
        (p, r) for p, r in zip(model.parameters(), ref, strict=True) if p.dtype == torch.bfloat16
    ]
    assert pairs
    norm = sum(float((r**2).sum()) for _, r in pairs) ** 0.5
    err = sum(float(((p.grad.double() - r) ** 2).sum()) for p, r in pairs) ** 0.5
    floor = sum(float(((r.to(torch.bfloat16).double() - r) ** 2).sum()) for _, r in pairs) ** 0.5
    same = sum(int((p.grad == r.to(torch.bfloat16)).sum()) for p, r in pairs)
    return err / norm, floor / norm, same / sum(p.numel() for p, _ in pairs)


@pytest.mark.parametrize("micro_batches", [8, 64, 256])
def test_fp32_accumulation_rounds_the_sum_once(micro_batches: int) -> None:
    data = batches(micro_batches)
    prec = Precision(FP32_ACCUM)
    model = prec.prepare(make_model())
    ref = reference(prec, model, data)
    accumulate(prec, model, data)
    rel, floor, same = errors(model, ref)
    assert rel <= floor * tol.ACCUM_FP32_OVER_ONE_ROUNDING, (rel, floor)
    assert same >= tol.ACCUM_FP32_ROUNDED_SHARE, same


@pytest.mark.parametrize("micro_batches", [8, 64, 256])
def test_bf16_accumulation_is_worse_than_one_rounding(micro_batches: int) -> None:
    """What the field fixes: summed in .grad, the error exceeds one rounding's."""
    data = batches(micro_batches)
    prec = Precision(BF16_MASTER)
    model = prec.prepare(make_model())
    ref = reference(prec, model, data)
    accumulate(prec, model, data)
    rel, floor, _ = errors(model, ref)
    assert rel > floor * tol.ACCUM_FP32_OVER_ONE_ROUNDING, (rel, floor)


def test_the_sum_lives_from_the_second_backward_to_the_step() -> None:
    prec = Precision(FP32_ACCUM)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-3)
    sixteen = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    accumulate(prec, model, batches(1))
    assert prec._accumulation.nbytes == 0  # one micro-batch: nothing to sum
    accumulate(prec, model, batches(1, seed=4))
    assert prec._accumulation.nbytes == 4 * sixteen
    assert prec.step(opt).applied
    assert prec._accumulation.nbytes == 0


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_restarts_the_sum(set_to_none: bool) -> None:
    """A step, and a zero_grad without one (a discarded batch), both start a new sum."""
    prec = Precision(FP32_ACCUM)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-3)
    accumulate(prec, model, batches(4, seed=5))
    prec.step(opt)
    opt.zero_grad(set_to_none=set_to_none)
    accumulate(prec, model, batches(4, seed=6))
    opt.zero_grad(set_to_none=set_to_none)  # discarded
    data = batches(16, seed=7)
    ref = reference(prec, model, data)
    accumulate(prec, model, data)
    rel, floor, same = errors(model, ref)
    assert rel <= floor * tol.ACCUM_FP32_OVER_ONE_ROUNDING, (rel, floor)
    assert same >= tol.ACCUM_FP32_ROUNDED_SHARE


def test_loss_scaling_sums_scaled_gradients_and_unscales_the_sum() -> None:
    """A power-of-two scale is exact in bf16: the unscaled .grad is the rounded sum."""
    pol = FP32_ACCUM.replace(loss_scaling=LossScaling.static(1024.0))
    prec = Precision(pol)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-3)
    data = batches(32)
    ref = reference(prec, model, data)
    accumulate(prec, model, data)
    prec.unscale_(opt)
    rel, floor, _ = errors(model, ref)
    assert rel <= floor * tol.ACCUM_FP32_OVER_ONE_ROUNDING, (rel, floor)
    assert prec.step(opt).applied


def test_a_skipped_step_releases_the_sum() -> None:
    prec = Precision(FP32_ACCUM)
    model = prec.prepare(make_model())
    opt = prec.optimizer(model, lr=1e-3)
    x, y = batches(1)[0]
    accumulate(prec, model, batches(3))
    with prec.autocast():
        loss = loss_fn(model(x * float("inf")), y)
    prec.backward(loss)
    assert not prec.step(opt).applied
    assert prec._accumulation.nbytes == 0
    opt.zero_grad()
    data = batches(8, seed=9)
    ref = reference(prec, model, data)
    accumulate(prec, model, data)
    assert errors(model, ref)[2] >= tol.ACCUM_FP32_ROUNDED_SHARE


def test_fp32_parameters_are_left_to_autograd() -> None:
    """fp32 storage (and fp32 islands) already sum in fp32: no hooks, no buffer."""
    prec = Precision(preset("amp_bf16").replace(grad_accum_dtype=torch.float32))
    model = prec.prepare(make_model())
    accumulate(prec, model, batches(4))
    assert prec._accumulation.nbytes == 0
    assert isinstance(prec.policy, Policy)


def test_state_saved_before_the_field_existed_loads_as_its_default() -> None:
    """Found while adding the field: a strict load compared the saved policy key by key,
    so every state saved before grad_accum_dtype existed would have been refused."""
    state = Precision(BF16_MASTER).state_dict()
    del state["policy"]["grad_accum_dtype"]
    Precision(BF16_MASTER).load_state_dict(state)
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        Precision(FP32_ACCUM).load_state_dict(state)


def test_fsdp2_models_are_refused_before_and_after_wrapping(tmp_path: Path) -> None:
    """FSDP2 sums sharded gradients in its own hook, where no tensor hook sees them: the
    field is refused rather than silently ignored, however the model was prepared."""
    from mixprec.distributed import shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        prec = Precision(FP32_ACCUM)
        with pytest.raises(PrecisionError, match="set_requires_gradient_sync"):
            prec.prepare(shard(make_model(), FP32_ACCUM))
        prec = Precision(FP32_ACCUM)
        model = shard(prec.prepare(make_model()), FP32_ACCUM)  # prepared, then wrapped
        with pytest.raises(PrecisionError, match="grad_accum_dtype=fp32 cannot reach"):
            prec.optimizer(model)
        # fp32 storage has no 16-bit gradient to sum: nothing to refuse (review: amp_bf16
        # with the field was refused under FSDP2).
        amp = preset("amp_bf16").replace(grad_accum_dtype=torch.float32)
        prec = Precision(amp)
        prec.optimizer(prec.prepare(shard(make_model(), amp)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("no_sync", [True, False])
def test_ddp_keeps_the_sum_only_with_no_sync(tmp_path: Path, no_sync: bool) -> None:
    """docs/runtime.md: under DDP the sum holds across micro-batches whose reduction is
    skipped (no_sync); a reduction on every micro-batch writes .grad back and restarts
    it, so the gradient is rounded at every micro-batch (one rank over gloo shows both)."""
    from mixprec.distributed import ddp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        prec = Precision(FP32_ACCUM)
        model = prec.prepare(ddp(make_model(), FP32_ACCUM))
        assert isinstance(model, nn.parallel.DistributedDataParallel)
        data = batches(64)
        ref = reference(prec, model.module, data)
        for i, (x, y) in enumerate(data):
            skip = no_sync and i < len(data) - 1
            with model.no_sync() if skip else contextlib.nullcontext():
                with prec.autocast():
                    loss = loss_fn(model(x), y)
                prec.backward(loss)
        rel, floor, _ = errors(model.module, ref)
        assert (rel <= floor * tol.ACCUM_FP32_OVER_ONE_ROUNDING) == no_sync, (rel, floor)
    finally:
        dist.destroy_process_group()
