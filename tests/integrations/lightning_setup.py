"""The shared run of the Lightning tests: a tiny HF Llama, fixed batches, a schedule,
a poisoned batch, the README loop and the LightningModule (imported by the tests and
by the resumed process they start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as pl
import torch
from lightning.pytorch import loggers
from runs import LR, Poison, make_model, policy, schedule

import mixprec

STEPS = 40  # two epochs of EPOCH batches: a checkpoint after the first resumes exactly
EPOCH = 20
POISONED = (7, 17)  # batches whose forward is poisoned: steps 7, 17, 27 and 37


def poisoned() -> list[torch.Tensor]:
    """The batches whose forward is poisoned (`POISONED`)."""
    every = batches()
    return [every[i] for i in POISONED]


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (4, 16), generator=g) for _ in range(EPOCH)]


def own_loop(name: str) -> tuple[list[float], list[float], torch.nn.Module, Any]:
    prec = mixprec.Precision(policy(name))
    model = prec.prepare(make_model())
    model.get_input_embeddings().register_forward_hook(Poison(poisoned()))
    opt = prec.optimizer(model, lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses, lrs = [], []
    for x in batches() * (STEPS // EPOCH):
        with prec.autocast():
            loss = model(input_ids=x, labels=x).loss
        prec.backward(loss)
        prec.clip_grad_norm_(model.parameters(), 1.0)
        report = prec.step(opt)
        if report.applied:
            sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs, model, opt


class Module(pl.LightningModule):
    def __init__(self, prec: mixprec.Precision) -> None:
        super().__init__()
        self.prec = prec
        self.model = make_model()
        self.model.get_input_embeddings().register_forward_hook(Poison(poisoned()))
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch: torch.Tensor, _index: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, *_args: Any) -> None:
        self.lrs.append(self.optimizers().param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt = self.prec.optimizer(self.model, lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(plugin: Any, tmp_path: Path, **kwargs: Any) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[plugin],
        gradient_clip_val=1.0,
        logger=loggers.CSVLogger(str(tmp_path)),
        enable_checkpointing=bool(kwargs.get("callbacks")),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kwargs,
    )


def loader() -> torch.utils.data.DataLoader[torch.Tensor]:
    return torch.utils.data.DataLoader(batches(), batch_size=None, shuffle=False)


def fabric_run(
    name: str, *, save_at: int | None = None, path: str | None = None, resume: bool = False
) -> tuple[list[float], torch.nn.Module, mixprec.Precision, dict[str, Any]]:
    """The run as a Fabric loop under the plugin; after `save_at` steps, ``fabric.save``
    to `path` (model, optimizer, scheduler, the plugin's loss scale); `resume` loads
    `path` first and runs the steps after `save_at`. Returns the losses, the model, the
    `Precision` and the optimizer's state (masters, moments)."""
    from mixprec.integrations.lightning import MixprecFabricPrecision

    prec = mixprec.Precision(policy(name))
    plugin = MixprecFabricPrecision(prec)
    fabric = pl.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = fabric.setup_module(make_model())
    net.get_input_embeddings().register_forward_hook(Poison(poisoned()))
    opt = fabric.setup_optimizers(prec.optimizer(net, lr=LR))
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, schedule)
    state = {"model": net, "optimizer": opt, "scheduler": sched, "precision": plugin}
    done = 0
    if resume:
        assert path is not None and save_at is not None
        fabric.load(path, state)
        done = save_at
    losses = []
    for step, x in enumerate(batches() * (STEPS // EPOCH)):
        if step < done:
            continue
        loss = net(input_ids=x, labels=x).loss
        fabric.backward(loss)
        fabric.clip_gradients(net, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        report = plugin.last_report
        if report is not None and report.applied:
            sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if not resume and save_at is not None and step + 1 == save_at:
            assert path is not None
            fabric.save(path, state)
    return losses, net, prec, opt.state_dict()["state"]


class ManualModule(Module):
    """`Module` under manual optimization: backward, clip and step written out."""

    def __init__(self, prec: mixprec.Precision) -> None:
        super().__init__(prec)
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, _index: int) -> torch.Tensor:
        opt = self.optimizers()
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()  # a HeldScheduler: held on a skipped step
        opt.zero_grad()
        return loss
