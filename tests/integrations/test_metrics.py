"""What the trainer integrations log after a step (`step_metrics`): one set of names."""

from __future__ import annotations

import torch

import mixprec
import mixprec.doctor as doctor
from mixprec.integrations.metrics import step_metrics


def test_the_doctors_runtime_findings_are_counted_by_rule() -> None:
    """Gradients that underflow fp16 (a loss scale of 1 on a loss of 1e-9) give the probe
    a ``gradient-underflow`` finding; the metrics a trainer logs count it."""
    scaling = mixprec.LossScaling(init_scale=1.0, dynamic=False)
    prec = mixprec.Precision(mixprec.preset("amp_fp16").replace(loss_scaling=scaling))
    model = prec.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    opt = prec.optimizer(model)
    probe = doctor.Probe(model=model, every=1)
    probe.attach(prec)
    for _ in range(3):
        with prec.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean() * 1e-9
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()
    metrics = step_metrics(prec)
    rules = {f.rule for f in probe.findings()}
    assert "gradient-underflow" in rules
    assert metrics["mixprec/doctor/gradient-underflow"] >= 1
    assert metrics["mixprec/applied_steps"] == 3 and metrics["mixprec/loss_scale"] == 1.0
    probe.detach()
    assert not any(k.startswith("mixprec/doctor/") for k in step_metrics(prec))


def test_without_loss_scaling_there_is_no_loss_scale() -> None:
    prec = mixprec.Precision("bf16_master")
    assert step_metrics(prec) == {"mixprec/applied_steps": 0.0, "mixprec/skipped_steps": 0.0}
