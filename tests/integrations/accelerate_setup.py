"""The shared run of the Accelerate tests: the README loop and the Accelerate loop over
the same tiny Llama, micro-batches, accumulation and poisoned batches (imported by the
tests and by the resumed process they start)."""

from __future__ import annotations

from typing import Any

import accelerate
import torch
from runs import LR, Poison, make_model, policy, schedule

import mixprec
from mixprec.integrations.accelerate import AcceleratedPrecision

MICRO = 80  # micro-batches: 40 steps of ACCUMULATE
ACCUMULATE = 2
POISONED = (15, 16, 55)  # micro-batches whose forward is poisoned: steps 7, 8 and 27


def poisoned() -> list[torch.Tensor]:
    """The batches whose forward is poisoned (`POISONED`)."""
    every = tokens().split(4)
    return [every[i] for i in POISONED]


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (MICRO * 4, 16), generator=g)


def own_loop(name: str) -> tuple[list[float], list[float], torch.nn.Module]:
    """The README loop with accumulation: the loss divided by the steps it spans."""
    prec = mixprec.Precision(policy(name))
    model = prec.prepare(make_model())
    model.get_input_embeddings().register_forward_hook(Poison(poisoned()))
    opt = prec.optimizer(model, lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses, lrs = [], []
    for i, x in enumerate(tokens().split(4)):
        with prec.autocast():
            loss = model(input_ids=x, labels=x).loss
        prec.backward(loss / ACCUMULATE)
        losses.append(float(loss.detach()))
        if (i + 1) % ACCUMULATE == 0:
            prec.clip_grad_norm_(model.parameters(), 1.0)
            if prec.step(opt).applied:
                sched.step()
            opt.zero_grad()
            lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs, model


def accelerate_run(
    name: str, *, save_at: int | None = None, resume: str | None = None, out: str | None = None
) -> tuple[list[float], list[float], torch.nn.Module, mixprec.Precision, dict[str, Any]]:
    """The same run as an Accelerate loop; `save_at` micro-batches in, ``save_state(out)``;
    `resume` loads a saved state and skips the micro-batches it covered. Returns the
    losses, learning rates, model, `Precision` and the optimizer's state (masters, moments)."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    prec = mixprec.Precision(policy(name))
    model = prec.prepare(make_model())
    model.get_input_embeddings().register_forward_hook(Poison(poisoned()))
    opt = prec.optimizer(model, lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data = torch.utils.data.TensorDataset(tokens())
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    loop = AcceleratedPrecision(accelerator, prec)
    done = 0
    if resume is not None:
        accelerator.load_state(resume)
        done = save_at or 0
        loader = accelerator.skip_first_batches(loader, done)
    losses, lrs = [], []
    for i, (x,) in enumerate(loader, start=done):
        with accelerator.accumulate(model):
            with prec.autocast():
                loss = model(input_ids=x, labels=x).loss
            loop.backward(loss)
            if loop.step(opt, sched, max_norm=1.0) is not None:
                lrs.append(opt.param_groups[0]["lr"])
        losses.append(float(loss.detach()))
        if resume is None and save_at is not None and i + 1 == save_at and out is not None:
            accelerator.save_state(out)
    return losses, lrs, model, prec, opt.state_dict()["state"]
