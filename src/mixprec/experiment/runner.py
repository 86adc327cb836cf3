"""The runner: train one policy with one seed, and run every run of a contract.

`run_one` is one run: the policy prepares a fresh model built from the seed,
the contract's optimizer (AdamW unless it names another, `optimizer.build_optimizer`)
follows the schedule of the run's `TrainSettings` (`lr_at`), and the
record collects losses, held-out evaluations, memory (predicted and measured),
the doctor's findings and throughput. For each seed, every policy starts from
bitwise the same fp32 initial weights (`Workload.make_model(seed)`) and sees the
same batches in the same order (`Workload.train_batch(step=, seed=)`), so
differences between runs are the policy's alone.

`run_experiment` runs every run of a contract: it resolves the plan
(`mixprec.experiment.plan`) and hands `run_one` to `orchestration.run_all`,
which orders the runs, resumes from stored records, adds seeds while a
candidate is inconclusive and keeps the output folder.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from mixprec.device import resolve_device
from mixprec.engine import Precision, StepReport
from mixprec.errors import PerformanceWarning, PrecisionError, PrecisionWarning
from mixprec.experiment.contract import Contract
from mixprec.experiment.fp8_trace import build_fp8_trace
from mixprec.experiment.hardware import device_facts
from mixprec.experiment.optimizer import build_optimizer, optimizer_label
from mixprec.experiment.orchestration import CONTRACT_FILE, RunFn, check_out_dir, run_all
from mixprec.experiment.plan import (
    RunSettings,
    evaluation_steps,
    settings_dict,
    settings_for,
    step_caps_for,
    workload_options,
)
from mixprec.experiment.records import RunRecord
from mixprec.islands import matches_fp32_module
from mixprec.memory import MemoryBreakdown, estimate, measure
from mixprec.policy import DEFAULT_FP32_MODULES, Policy, preset
from mixprec.workloads import Workload, load_workload
from mixprec.workloads.base import stream_seed
from mixprec.workloads.settings import TrainSettings, lr_at

__all__ = [
    "CONTRACT_FILE",
    "RunSettings",
    "check_out_dir",
    "doctor_for",
    "evaluation_steps",
    "lr_at",
    "model_seed",
    "predicted_bytes",
    "run_experiment",
    "run_one",
    "settings_dict",
    "settings_for",
    "step_caps_for",
    "training_step",
    "workload_options",
]

_MAX_CURVE_POINTS = 400


def _downsample(points: list[list[float]], limit: int = _MAX_CURVE_POINTS) -> list[list[float]]:
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    kept = points[::stride]
    if kept[-1] is not points[-1]:
        kept.append(points[-1])
    return kept


def _norm_param_names(model: nn.Module) -> set[str]:
    """Names of norm-layer parameters (by the default fp32-island patterns)."""
    probe = Policy(fp32_modules=DEFAULT_FP32_MODULES)
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        if matches_fp32_module(probe, mod_name, module):
            for p_name, _ in module.named_parameters():
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def _frozen_fraction(model: nn.Module, initial: dict[str, torch.Tensor]) -> dict[str, float]:
    norm_names = _norm_param_names(model)
    counts = {"all": [0, 0], "norm": [0, 0]}
    for name, p in model.named_parameters():
        same = int((p.detach() == initial[name]).sum())
        for key in ("all", "norm") if name in norm_names else ("all",):
            counts[key][0] += same
            counts[key][1] += p.numel()
    return {k: same / total for k, (same, total) in counts.items() if total}


def doctor_for(
    prec: Precision,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    every: int,
    *,
    probe: bool = True,
) -> tuple[list[dict[str, Any]], Any]:
    """Static findings and an attached runtime probe (None without `probe`), when the
    doctor is available (also `mixprec train`'s: both runs are observed alike)."""
    try:
        from mixprec import doctor
    except ImportError:  # the doctor is optional for the runner
        return [], None
    static = [
        f.to_dict()
        for f in doctor.check(
            policy=prec.policy, model=model, optimizer=optimizer, device=prec.device
        )
    ]
    if not probe:
        return static, None
    # Exactly every `every` steps, not by a time budget: a record, and the update-path
    # gate that reads the probe's findings, must not depend on how fast the machine was.
    attached = doctor.Probe(every=every, overhead_budget=None)
    attached.attach(prec, model)
    return static, attached


def predicted_bytes(
    workload: Workload,
    model: nn.Module,
    pol: Policy,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: str,
) -> dict[str, int]:
    """The memory estimate of one step on `batch` (a fake-tensor forward: nothing trains)."""
    x, y = batch
    return estimate(
        model,
        pol,
        inputs=x,
        loss_fn=workload.loss,
        targets=y,
        device_type=torch.device(device).type,
    ).bytes.to_dict()


def model_seed(seed: int, step: int, rank: int = 0) -> int:
    """The seed of torch's global random numbers in step `step` of a run of `seed`, on
    `rank` (`training_step`'s `rng_seed`)."""
    return stream_seed(seed, step, stream="model" if rank == 0 else f"model/rank{rank}")


def training_step(
    workload: Workload,
    prec: Precision,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    train: TrainSettings,
    *,
    rng_seed: int,
) -> tuple[torch.Tensor, StepReport]:
    """One optimizer step on `(x, y)` (compare's runs and `mixprec train` take the same).

    The forward and backward draw torch's global random numbers (dropout) from a
    stream seeded with `rng_seed` (`model_seed`), and leave the caller's stream where
    it was: every policy's run of a seed sees the same draws at each step, a rerun
    sees them again, and a resumed run sees those of the run that never stopped.

    Returns:
        The loss (detached) and the step's report.
    """
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(rng_seed)
        with prec.autocast():
            out = model(x)
        loss = workload.loss(out, y)
        prec.backward(loss)
    # An infinite norm clips nothing; under gradient release the gradients are gone by
    # now, so it is not measured either (a finite one is refused before the run).
    if train.grad_clip_norm is not None and not (
        prec.policy.release_gradients and math.isinf(train.grad_clip_norm)
    ):
        prec.clip_grad_norm_(model.parameters(), train.grad_clip_norm)
    report = prec.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), report


def run_one(
    workload: Workload,
    policy_name: str,
    seed: int,
    settings: RunSettings,
    *,
    fingerprint: str = "",
    device: str = "cpu",
    run_steps: int | None = None,
    eval_at: frozenset[int] = frozenset(),
    progress: Callable[[int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_step: Callable[[int, Mapping[str, float]], None] | None = None,
) -> RunRecord:
    """Train `workload` under one policy with one seed and return its record.

    `run_steps` stops the run early (the schedule stays that of `settings.train.steps`);
    `eval_at` adds held-out evaluations after those steps (for capped comparisons).
    `on_step` gets each step's figures as they come, keyed by steps done (0: the
    initial evaluation): ``train_loss``, ``loss_scale`` (scaled policies),
    ``steps_per_s`` (the loop's mean so far, the first step left out, as in the
    record), and ``heldout_loss`` with ``heldout_<metric>`` where evaluated (what a
    tracker logs, `mixprec.experiment.tracked`).
    """
    train = settings.train
    total = train.steps if run_steps is None else min(run_steps, train.steps)
    start = time.perf_counter()
    pol = preset(policy_name)
    base: dict[str, Any] = {
        "workload": workload.name,
        "size": str(workload.config.get("size", "")),
        "policy": pol.name if policy_name == pol.name else policy_name,
        "policy_fields": pol.to_dict(),
        "seed": seed,
        "steps": total,
        "schedule_steps": train.steps,
        "fingerprint": fingerprint,
        "metric_name": workload.metric_name,
        "optimizer": optimizer_label(settings.optimizer, settings.optimizer_args),
    }
    prec = Precision(pol, device=device)
    model = workload.make_model(seed).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        warnings.simplefilter("ignore", PrecisionWarning)
        prec.prepare(model)
        optimizer = build_optimizer(prec, model, settings.optimizer, settings.optimizer_args, train)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    static, probe = doctor_for(prec, model, optimizer, settings.probe_every)

    losses: list[list[float]] = []
    evals: list[list[float]] = []
    nonfinite = 0
    measured: dict[str, int] = {}
    predicted: dict[str, int] = {}
    error = ""
    train_time = 0.0
    timed_steps = 0

    def train_step(x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        rng_seed = model_seed(seed, step)
        return training_step(workload, prec, model, optimizer, x, y, train, rng_seed=rng_seed)[0]

    def measured_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, MemoryBreakdown]:
        out: list[torch.Tensor] = []
        mem = measure(model, optimizer, lambda: out.append(train_step(x, y, 0)), policy=pol)
        return out[0], mem

    def evaluate(done: int, values: dict[str, float]) -> float:
        result = workload.evaluate(model, autocast=prec.autocast)
        if on_step is not None:
            values["heldout_loss"] = result.loss
            values[f"heldout_{workload.metric_name}"] = result.metric
            on_step(done, values)
        return result.loss

    # Step 0: the initial weights under this policy (the decision's trained-at-all check).
    evals.append([0, evaluate(0, {})])
    try:
        first_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        if total:
            # Memory is predicted from outside the loop, before the first step: a probe
            # may hook the model after a non-finite step, and the estimate's fake-tensor
            # forward must not run through it. The first step then trains on this batch.
            first_batch = workload.train_batch(
                step=0, seed=seed, batch_size=train.batch_size, device=device
            )
            predicted = predicted_bytes(workload, model, pol, first_batch, device)
        for step in range(total):
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt  # a safe point: between steps, no record written
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, train)
            if step == 0 and first_batch is not None:
                x, y = first_batch
            else:
                x, y = workload.train_batch(
                    step=step, seed=seed, batch_size=train.batch_size, device=device
                )
            t0 = time.perf_counter()
            if step == 0:
                loss_t, mem = measured_step(x, y)
                measured = mem.bytes.to_dict()
            else:
                loss_t = train_step(x, y, step)
                train_time += time.perf_counter() - t0
                timed_steps += 1
            loss_v = float(loss_t)
            if not math.isfinite(loss_v):
                nonfinite += 1
            losses.append([step, loss_v])
            if progress is not None:
                progress(step, loss_v)
            done = step + 1
            values: dict[str, float] = {"train_loss": loss_v}
            if prec.stats.loss_scale is not None:
                values["loss_scale"] = prec.stats.loss_scale
            if timed_steps:
                values["steps_per_s"] = timed_steps / train_time
            if done < total and (done % settings.eval_every == 0 or done in eval_at):
                evals.append([step + 1, evaluate(done, values)])
            elif on_step is not None:
                on_step(done, values)
    except PrecisionError as exc:
        error = str(exc).splitlines()[0]
    finally:
        if probe is not None:
            probe.detach()
    final = workload.evaluate(model, autocast=prec.autocast)
    evals.append([len(losses), final.loss])
    if on_step is not None:
        on_step(
            len(losses),
            {"heldout_loss": final.loss, f"heldout_{workload.metric_name}": final.metric},
        )
    tail = [v for _, v in losses[-max(1, len(losses) // 10) :] if math.isfinite(v)]
    findings = static + ([f.to_dict() for f in probe.findings()] if probe is not None else [])
    probes = probe.summary() if probe is not None and hasattr(probe, "summary") else {}
    sampled = getattr(probe, "samples", ()) if probe is not None else ()
    fp8_trace = build_fp8_trace([t for s in sampled for t in getattr(s, "fp8", ())])
    return RunRecord(
        **base,
        status="failed" if error else "ok",
        error=error,
        final_train_loss=sum(tail) / len(tail) if tail else math.nan,
        heldout_loss=final.loss,
        metric=final.metric,
        nonfinite_steps=nonfinite,
        skipped_steps=prec.stats.skipped_steps,
        loss_curve=_downsample(losses),
        eval_curve=evals,
        loss_scale_trace=[list(item) for item in prec.stats.scale_history],
        bytes=measured,
        predicted_bytes=predicted,
        throughput={
            "steps_per_s": timed_steps / train_time if train_time else math.nan,
            "examples_per_s": timed_steps * train.batch_size / train_time
            if train_time
            else math.nan,
        },
        wall_time_s=time.perf_counter() - start,
        frozen_fraction=_frozen_fraction(model, initial),
        probes=dict(probes),
        doctor=findings,
        effective=prec.describe(),
        device=device_facts(device),
        fp8_trace=fp8_trace,
    )


def run_experiment(
    contract: Contract,
    out_dir: Path,
    *,
    device: str = "cpu",
    allow_import: bool = False,
    stream: TextIO | None = sys.stderr,
    on_record: Callable[[RunRecord, bool], None] | None = None,
    workload: Workload | None = None,
    should_stop: Callable[[], bool] | None = None,
    run: RunFn | None = None,
) -> tuple[Workload, list[RunRecord]]:
    """Run (or resume) every run of `contract`, writing records under `out_dir/runs`.

    Every policy runs seeds ``0..contract.seeds-1``. While a candidate's gap is
    inconclusive (`decide`), the baseline and the inconclusive candidates run
    one more seed, up to ``contract.seed_limit``.

    Args:
        contract: what to run.
        out_dir: the output folder (created).
        device: the device to train on.
        allow_import: the workload may be a ``module:function`` spec (command line only).
        stream: where progress goes (None: silent).
        on_record: called with each record and whether it was reused from disk.
        workload: the workload object (for a library call); default: loaded from
            ``contract.workload``.
        should_stop: polled before every training step; True raises
            KeyboardInterrupt there (the command line's Ctrl-C). Finished runs are kept.
        run: trains one run (default `run_one`; `compare` passes it wrapped by its
            tracker, `mixprec.experiment.tracked`).

    Returns:
        The workload and the records, in the order they ran (baseline first per seed).
    """
    device = str(resolve_device(device))
    check_out_dir(out_dir)
    if workload is None:
        workload = load_workload(
            contract.workload, allow_import=allow_import, **workload_options(contract)
        )
    settings = settings_for(contract, workload)
    settings.check_release(contract.policies)
    return workload, run_all(
        contract,
        out_dir,
        workload,
        settings,
        run=run_one if run is None else run,
        device=device,
        stream=stream,
        on_record=on_record,
        should_stop=should_stop,
    )
