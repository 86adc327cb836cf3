"""The AMP examples of the PyTorch docs, written with `Precision`, equal `torch.amp` bitwise.

Each example (https://pytorch.org/docs/stable/notes/amp_examples.html: the typical
loop, gradient clipping, gradient accumulation, gradient penalty, several models,
losses and optimizers) runs twice from the same weights and data: once as the docs
write it with `torch.autocast` + `torch.amp.GradScaler`, once with
`mixprec.Precision("amp_fp16")` and the same `torch.optim` optimizers. Parameters,
optimizer state and the loss scale must agree bit for bit. fp16 autocast on CPU is
emulated and slow: the models are tiny.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mixprec import Precision

# fp16 is emulated on most CPUs: the engine says so once per prepare.
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.errors.PerformanceWarning")

DEVICE = "cpu"
STEPS = 4


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(n)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def _same(a: nn.Module, b: nn.Module, oa: torch.optim.Optimizer, ob: torch.optim.Optimizer) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    for sa, sb in zip(oa.state.values(), ob.state.values(), strict=True):
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def _pair(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer, Precision]:
    ref = _model()
    ours = copy.deepcopy(ref)
    prec = Precision("amp_fp16", device=DEVICE)
    prec.prepare(ours)  # fp32 storage: nothing changes
    return ref, make_opt(ref), ours, prec.register(make_opt(ours)), prec


def _adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_typical_mixed_precision_training() -> None:
    ref, ref_opt, ours, opt, prec = _pair(_adamw)
    scaler = torch.amp.GradScaler(DEVICE)
    for x, y in _batches(STEPS):
        ref_opt.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = _loss(ref(x), y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()

        opt.zero_grad()
        with prec.autocast():
            loss = _loss(ours(x), y)
        prec.backward(loss)
        prec.step(opt)
    _same(ref, ours, ref_opt, opt)
    assert scaler.get_scale() == prec.loss_scale


def test_gradient_clipping() -> None:
    ref, ref_opt, ours, opt, prec = _pair(_adamw)
    scaler = torch.amp.GradScaler(DEVICE)
    for x, y in _batches(STEPS):
        ref_opt.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = _loss(ref(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        scaler.step(ref_opt)
        scaler.update()

        opt.zero_grad()
        with prec.autocast():
            loss = _loss(ours(x), y)
        prec.backward(loss)
        prec.clip_grad_norm_(ours.parameters(), 0.1)
        prec.step(opt)
    _same(ref, ours, ref_opt, opt)


def test_gradient_accumulation() -> None:
    ref, ref_opt, ours, opt, prec = _pair(_adamw)
    scaler = torch.amp.GradScaler(DEVICE)
    accumulate = 2
    for i, (x, y) in enumerate(_batches(STEPS * accumulate)):
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = _loss(ref(x), y) / accumulate
        scaler.scale(loss).backward()
        with prec.autocast():
            ours_loss = _loss(ours(x), y) / accumulate
        prec.backward(ours_loss)
        if (i + 1) % accumulate == 0:
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
            prec.step(opt)
            opt.zero_grad()
    _same(ref, ours, ref_opt, opt)


def test_gradient_penalty() -> None:
    ref, ref_opt, ours, opt, prec = _pair(_adamw)
    scaler = torch.amp.GradScaler(DEVICE)

    def penalized(
        model: nn.Module,
        scale_loss: Callable[[torch.Tensor], torch.Tensor],
        scale: float,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> torch.Tensor:
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = _loss(model(x), y)
        scaled = torch.autograd.grad(
            outputs=scale_loss(loss), inputs=list(model.parameters()), create_graph=True
        )
        grads = [g * (1.0 / scale) for g in scaled]
        with torch.autocast(DEVICE, dtype=torch.float16):
            norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            return loss + norm

    for x, y in _batches(STEPS):
        ref_opt.zero_grad()
        loss = penalized(ref, scaler.scale, scaler.get_scale(), x, y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()

        opt.zero_grad()
        loss = penalized(ours, prec.scaler.scale, prec.scaler.get_scale(), x, y)
        prec.backward(loss)
        prec.step(opt)
    _same(ref, ours, ref_opt, opt)


def test_multiple_models_losses_and_optimizers() -> None:
    ref0, ref1 = _model(0), _model(1)
    ours0, ours1 = copy.deepcopy(ref0), copy.deepcopy(ref1)
    ref_opts = [torch.optim.SGD(ref0.parameters(), lr=1e-2), _adamw(ref1)]
    prec = Precision("amp_fp16", device=DEVICE)
    opts = [
        prec.register(torch.optim.SGD(ours0.parameters(), lr=1e-2)),
        prec.register(_adamw(ours1)),
    ]
    scaler = torch.amp.GradScaler(DEVICE)
    for x, y in _batches(STEPS):
        for o in (*ref_opts, *opts):
            o.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.float16):
            a, b = ref0(x), ref1(x)
            loss0 = _loss(0.3 * a + 0.7 * b, y)
            loss1 = _loss(0.6 * a - 0.4 * b, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(ref_opts[0])  # the docs unscale one optimizer to inspect it
        for o in ref_opts:
            scaler.step(o)
        scaler.update()

        with prec.autocast():
            a, b = ours0(x), ours1(x)
            loss0 = _loss(0.3 * a + 0.7 * b, y)
            loss1 = _loss(0.6 * a - 0.4 * b, y)
        prec.backward(loss0, retain_graph=True)
        prec.backward(loss1)
        prec.unscale_(opts[0])
        prec.step(opts)
    _same(ref0, ours0, ref_opts[0], opts[0])
    _same(ref1, ours1, ref_opts[1], opts[1])
