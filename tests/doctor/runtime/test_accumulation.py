"""grad-accum-16bit (issue 30, item 2): gradient accumulation in bf16 .grad was silent;
the probe now measures it against an fp32 sum of the same gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.doctor import Probe
from mixprec.errors import PrecisionWarning

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.errors.PerformanceWarning")


def _run(
    pol: mixprec.Policy,
    micro_batches: int,
    *,
    model_known: bool,
    steps: int = 3,
    clip: float | None = None,
) -> Probe:
    prec = mixprec.Precision(pol)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        model = prec.prepare(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)))
    opt = prec.optimizer(model, lr=1e-3)
    probe = Probe(every=1, overhead_budget=None, model=model if model_known else None)
    g = torch.Generator().manual_seed(1)
    with probe.watching(prec):
        for _ in range(steps):
            for _ in range(micro_batches):
                with prec.autocast():
                    loss = model(torch.randn(8, 16, generator=g)).float().pow(2).mean()
                prec.backward(loss / micro_batches)
            if clip is not None:
                prec.clip_grad_norm_(model.parameters(), clip)
            prec.step(opt)
            opt.zero_grad()
    return probe


def _accum(probe: Probe) -> list[mixprec.doctor.Finding]:
    return [f for f in probe.findings() if f.rule == "grad-accum-16bit"]


@pytest.mark.parametrize("model_known", [True, False])
def test_bf16_accumulation_is_reported_with_its_measured_error(model_known: bool) -> None:
    (finding,) = _accum(_run(mixprec.preset("bf16_master"), 64, model_known=model_known))
    ev = finding.evidence
    assert finding.severity == "warning"
    assert ev["backwards"] == 64 and ev["grad_dtype"] == "bf16"
    # Summed in bf16 64 times: well above what one rounding of the fp32 sum leaves.
    assert ev["relative_error"] > 2 * ev["fp32_accumulation_error"] > 0
    assert ev["first_step"] == (0 if model_known else 1)
    assert "grad_accum_dtype: fp32" in finding.fix


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "loss-scaled"])
def test_clipping_and_unscaling_are_not_counted_as_accumulation_error(scaled: bool) -> None:
    """Reported: after the README's prec.clip_grad_norm_ the error read 47% at 8
    micro-batches (1 - the clip coefficient), where the summation's was 0.35%."""
    pol = mixprec.preset("bf16_master")
    if scaled:
        pol = pol.replace(loss_scaling=mixprec.LossScaling(init_scale=2.0**10, dynamic=False))
    plain = _accum(_run(pol, 8, model_known=True, steps=1))[0].evidence
    for max_norm in (1.0, 0.01):  # clips by about 0.5 and 0.005
        clipped = _accum(_run(pol, 8, model_known=True, steps=1, clip=max_norm))[0].evidence
        # The clip's multiply rounds .grad once more: at most one rounding's error added.
        assert clipped["relative_error"] == pytest.approx(plain["relative_error"], rel=0.5)
        assert clipped["relative_error"] > 1.2 * clipped["fp32_accumulation_error"]


def test_the_field_and_a_single_micro_batch_are_not_reported() -> None:
    fixed = mixprec.preset("bf16_master").replace(grad_accum_dtype=torch.float32)
    assert not _accum(_run(fixed, 8, model_known=True))
    assert not _accum(_run(mixprec.preset("bf16_master"), 1, model_known=True))
    assert not _accum(_run(mixprec.preset("amp_bf16"), 8, model_known=True))


def test_the_witness_changes_nothing_and_leaves_no_hooks() -> None:
    """The probe's fp32 sums only witness: the run's gradients are the same with it."""
    pol = mixprec.preset("bf16_master")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        grads = []
        for watched in (False, True):
            prec = mixprec.Precision(pol)
            torch.manual_seed(0)
            model = prec.prepare(nn.Linear(16, 4))
            probe = Probe(every=1, overhead_budget=None, model=model)
            g = torch.Generator().manual_seed(1)
            with probe.watching(prec) if watched else warnings.catch_warnings():
                for _ in range(16):
                    with prec.autocast():
                        prec.backward(model(torch.randn(8, 16, generator=g)).float().sum())
                grads.append(model.weight.grad.clone())
            assert not model.weight._backward_hooks
            assert not model.weight._post_accumulate_grad_hooks
    assert torch.equal(grads[0], grads[1])
