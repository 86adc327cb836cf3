"""`train`: one long run of a `Recipe`, with progress, probes, checkpoints, resume and export.

Each step is the one compare's runs take (`runner.training_step`): the workload's
model built from the seed, `Precision.prepare`, the recipe's optimizer
(`optimizer.build_optimizer`) with the schedule's weight decay and betas, the learning
rate of step ``k`` from `lr_at` and the batch of step ``k`` (``Workload.train_batch``). The
data position is therefore the step: each checkpoint records it (with the
workload and the training settings) and a resume checks it (`experiment.resume`).

The output folder holds::

    recipe.json      the recipe (its dict form); a resume starts from it
    metrics.jsonl    one line per step (`metrics_log`); cut back on resume
    checkpoints/     `mixprec.checkpoint.save` every `save_every` steps, after the
                     last step and when stopped; the newest `keep_last` are kept
    export/          `mixprec.checkpoint.export` of the final weights
    train.json       the summary, also written when the run stops early

A stop request (`should_stop`, polled between steps: the command line's Ctrl-C
and SIGTERM) or `stop_after` ends the run after the step in progress, with a
checkpoint. Resuming from it gives bitwise the run that was never stopped.

Under a process group of several ranks (``torchrun``, or ``mixprec train --nproc``)
the run is data-parallel: the model is wrapped by `mixprec.distributed.shard`
(FSDP2, the default) or `mixprec.distributed.ddp`, each rank trains on its
contiguous share of step ``k``'s global batch (the batch size must divide by the
number of ranks), the logged loss is the mean over ranks, a stop request on any
rank stops every rank after the same step, checkpoints are collective, and rank 0
alone writes the folder's files and shows progress. The runtime probe watches
one-process runs only; the doctor's static checks run on every rank.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from mixprec import distributed
from mixprec.device import resolve_device
from mixprec.engine import Precision
from mixprec.engine.gradients import any_across_ranks
from mixprec.errors import PerformanceWarning, PrecisionWarning
from mixprec.experiment.metrics_log import MetricsLog, NoMetrics
from mixprec.experiment.optimizer import build_optimizer
from mixprec.experiment.orchestration import check_out_dir, exclusive
from mixprec.experiment.plan import RunSettings, settings_dict, settings_for, workload_options
from mixprec.experiment.progress import Progress, finding_line
from mixprec.experiment.recipe import Recipe
from mixprec.experiment.records import strict_json, write_json_atomic
from mixprec.experiment.resume import RESUME, check_run, check_trained_as, resume_point, run_state
from mixprec.experiment.runner import doctor_for, model_seed, predicted_bytes, training_step
from mixprec.experiment.tracked import TrainTracking
from mixprec.tracking import Tracker, guarded, tracker_failed
from mixprec.workloads import EvalResult, Workload, load_workload
from mixprec.workloads.settings import lr_at

# `mixprec.checkpoint` is imported when a run starts: compare (`import mixprec.experiment`)
# needs no torch.distributed.checkpoint.
if TYPE_CHECKING:
    from mixprec.checkpoint import CheckpointInfo

__all__ = [
    "CHECKPOINTS",
    "METRICS_FILE",
    "RECIPE_FILE",
    "STRATEGIES",
    "SUMMARY_FILE",
    "TrainResult",
    "stored_recipe",
    "train",
]

RECIPE_FILE = "recipe.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "train.json"
CHECKPOINTS = "checkpoints"
EXPORT = "export"
#: How a run of several ranks is wrapped (the first is the default).
STRATEGIES = ("fsdp2", "ddp")


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a call of `train` did."""

    out: Path
    """The output folder."""
    step: int
    """Optimizer steps done (over every call that trained this run)."""
    steps: int
    """Steps of the whole run (its schedule)."""
    finished: bool
    """The last step is done and the weights are exported."""
    checkpoint: Path | None
    """The newest checkpoint, None when none was saved."""
    summary: dict[str, Any]
    """What ``train.json`` holds."""


def stored_recipe(out: str | Path) -> dict[str, Any] | None:
    """The dict form of the recipe a run in `out` was started with; None without one.

    Raises:
        ValueError: the file is not a JSON mapping.
    """
    path = Path(out) / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no recipe (a JSON mapping)")
    return data


def train(
    recipe: Recipe | Mapping[str, Any],
    out: str | Path,
    *,
    resume: str | None = None,
    stop_after: int | None = None,
    device: str = "cpu",
    workload: Workload | None = None,
    allow_import: bool = False,
    stream: TextIO | None = sys.stderr,
    should_stop: Callable[[], bool] | None = None,
    strategy: str = "fsdp2",
    tracker: Tracker | None = None,
    ranks_as_saved: bool = False,
) -> TrainResult:
    """Train `recipe` into the folder `out`, or go on with the run there.

    Args:
        recipe: a `Recipe` or its dict form.
        out: the output folder (created).
        resume: None: a new run (refused when `out` holds checkpoints); ``"latest"``:
            go on from the checkpoint ``latest`` names (refused when it does not
            verify); ``"latest-valid"``: from the newest that verifies.
        stop_after: stop after this many steps of this call, with a checkpoint (a
            time slice; resume later). None: run to the end.
        device: the device to train on.
        workload: the workload object; default: loaded from ``recipe.workload``.
        allow_import: ``recipe.workload`` may be a ``module:function`` (command line only).
        stream: where the progress bar and the doctor's findings go (None: silent).
        should_stop: polled before every step; True stops there as `stop_after` does
            (on any rank: every rank stops after the same step).
        strategy: under a process group of several ranks, ``"fsdp2"`` or ``"ddp"``
            (see the module docs).
        tracker: also log the run there (`mixprec.tracking.open_tracker`; rank 0
            only); see `mixprec.experiment.tracked`. A failure while tracking warns
            once and training goes on.
        ranks_as_saved: resuming, refuse a checkpoint saved by another number of
            ranks (one resumes on any number, equal within the reduction order; the
            command line asks for this when neither ``--nproc`` nor torchrun chose).

    Returns:
        The `TrainResult`; ``train.json`` holds its summary.

    Raises:
        ValueError: bad input; `out` holds a run and `resume` is None; nothing to
            resume; a checkpoint of another policy, workload, seed or training
            settings (naming what differs). A damaged checkpoint raises
            `mixprec.checkpoint.CheckpointError` (a ValueError).
        PrecisionError: training cannot go on (a collapsing loss scale); the
            checkpoints and metrics so far are kept.
    """
    if not isinstance(recipe, Recipe):
        recipe = Recipe.from_dict(recipe)
    if resume is not None and resume not in RESUME:
        raise ValueError(f"resume must be None or one of {', '.join(RESUME)}, got {resume!r}")
    if stop_after is not None and (
        isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1
    ):
        raise ValueError(f"stop_after must be an int >= 1 (steps) or None, got {stop_after!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    device = str(resolve_device(device))
    if workload is None:
        workload = load_workload(
            recipe.workload, allow_import=allow_import, **workload_options(recipe)
        )
    settings = settings_for(recipe, workload)
    settings.check_release([recipe.policy])
    world = distributed.world_size()
    if settings.train.batch_size % world:
        raise ValueError(
            f"batch_size {settings.train.batch_size} does not divide among {world} ranks; "
            f"choose a batch size that is a multiple of {world} (each rank takes an equal share)"
        )
    if distributed.rank() != 0:
        stream = None  # rank 0 shows progress
        tracker = None  # and logs to the tracker
    out = Path(out)
    if resume is not None and not out.is_dir():
        raise ValueError(f"nothing to resume: {out} does not exist; start without --resume")
    check_out_dir(out)
    lock = exclusive(out, "train") if distributed.rank() == 0 else contextlib.nullcontext()
    with lock:
        run = _Run(recipe, workload, settings, out, device=device, stream=stream, strategy=strategy)
        run.tracker = None if tracker is None else guarded(tracker)
        return run.run(
            resume=resume,
            stop_after=stop_after,
            should_stop=should_stop,
            ranks_as_saved=ranks_as_saved,
        )


class _Run:
    """One call of `train`: the objects of the run and its loop."""

    def __init__(
        self,
        recipe: Recipe,
        workload: Workload,
        settings: RunSettings,
        out: Path,
        *,
        device: str,
        stream: TextIO | None,
        strategy: str,
    ) -> None:
        self.recipe = recipe
        self.workload = workload
        self.settings = settings
        self.out = out
        self.device = device
        self.stream = stream
        self.root = out / CHECKPOINTS
        t = settings.train
        self.world, self.rank = distributed.world_size(), distributed.rank()
        self.strategy = strategy if self.world > 1 else None
        self.prec = Precision(recipe.policy, device=device)
        self.model = workload.make_model(recipe.seed).to(device)
        with warnings.catch_warnings():  # the doctor reports these as findings
            warnings.simplefilter("ignore", PerformanceWarning)
            warnings.simplefilter("ignore", PrecisionWarning)
            if self.strategy == "fsdp2":
                self.model = distributed.shard(self.model, self.prec.policy)
            elif self.strategy == "ddp":
                self.model = distributed.ddp(self.model, self.prec.policy)
            self.prec.prepare(self.model)
            # The seed of stochastic rounding (bf16_sr) comes from the recipe, not from
            # torch's default generator: a new process repeats the run.
            opt_args = (settings.optimizer, settings.optimizer_args)
            self.optimizer = build_optimizer(self.prec, self.model, *opt_args, t, seed=recipe.seed)
        self.config = json.loads(json.dumps(workload.config, default=str))  # plain data
        self.latest: CheckpointInfo | None = None
        self.elapsed_before = 0.0  # training time of earlier calls (from the checkpoint)
        self.began = time.perf_counter()
        self.start = 0  # the step this call began at
        self.done = 0  # steps done
        self.saved = 0  # the step of the newest checkpoint (or where this call began)
        self.last_eval: tuple[int, EvalResult] | None = None
        self.step_time = 0.0  # seconds in timed steps of this call
        self.timed = 0
        self.tracker: Tracker | None = None
        self.tracking: TrainTracking | None = None

    # ------------------------------------------------------------ resume

    def _start(self, resume: str | None, *, ranks_as_saved: bool) -> int:
        """The step the run goes on from (0: a new run), restored from a checkpoint."""
        from mixprec.checkpoint import load

        info = resume_point(
            self.root, self.out, resume, world=self.world, ranks_as_saved=ranks_as_saved
        )
        if info is None:
            return 0
        check_trained_as(info, self.prec.policy, self.optimizer, self.recipe.optimizer)
        loaded = load(info.path, model=self.model, optimizer=self.optimizer, precision=self.prec)
        check_run(info, loaded["extra"], self._extra(info.step, 0.0), self.out / RECIPE_FILE)
        self.latest = info
        elapsed = loaded["extra"].get("elapsed_s", 0.0)
        self.elapsed_before = float(elapsed) if isinstance(elapsed, int | float) else 0.0
        return info.step

    def _extra(self, step: int, elapsed: float) -> dict[str, Any]:
        return run_state(
            self.recipe,
            self.workload.name,
            self.config,
            self.settings.train,
            step=step,
            elapsed=elapsed,
        )

    # -------------------------------------------------------------- loop

    def run(
        self,
        *,
        resume: str | None,
        stop_after: int | None,
        should_stop: Callable[[], bool] | None,
        ranks_as_saved: bool,
    ) -> TrainResult:
        first_batch = self._batch(0)
        # Before the probe hooks anything and before a checkpoint restores the RNGs
        # (the estimate runs a fake-tensor forward).
        predicted = (  # one rank's share under a wrapper: `mixprec budget --world-size`
            predicted_bytes(self.workload, self.model, self.prec.policy, first_batch, self.device)
            if self.world == 1
            else {}
        )
        start = self._start(resume, ranks_as_saved=ranks_as_saved)
        if self.rank == 0:
            write_json_atomic(self.out / RECIPE_FILE, self.recipe.to_dict())
        if self.tracker is not None:
            self.tracking = self._track(start)
        try:
            return self._train(start, first_batch, predicted, stop_after, should_stop)
        except BaseException as exc:
            if self.tracking is not None:
                self.tracking.abort(exc)
            raise

    def _train(
        self,
        start: int,
        first_batch: tuple[torch.Tensor, torch.Tensor],
        predicted: dict[str, int],
        stop_after: int | None,
        should_stop: Callable[[], bool] | None,
    ) -> TrainResult:
        from mixprec.checkpoint import export

        total = self.settings.train.steps
        static, probe = doctor_for(
            self.prec,
            self.model,
            self.optimizer,
            self.settings.probe_every,
            probe=self.world == 1,
        )
        if self.stream is not None:
            print(self._header(start), file=self.stream)
            if self.tracking is not None and self.tracking.where:
                print(f"tracking: {self.tracking.where}", file=self.stream)
            for finding in static:
                print(finding_line(finding), file=self.stream)
        self.start = self.done = self.saved = start
        self.began = time.perf_counter()
        progress = Progress(self.stream, start=start, total=total)
        try:
            log = (
                MetricsLog(self.out / METRICS_FILE, keep_through=start)
                if self.rank == 0
                else contextlib.nullcontext(NoMetrics())
            )
            with log as metrics:
                for step in range(start, total):
                    stop = (should_stop is not None and should_stop()) or (
                        stop_after is not None and step - start >= stop_after
                    )
                    if any_across_ranks(stop, torch.device(self.device)):  # every rank stops alike
                        break
                    line = self._step(step, first_batch if step == 0 else self._batch(step))
                    metrics.write(line)
                    if self.tracking is not None:
                        self.tracking.step(line)
                    progress.step(line, self.prec, self.workload.metric_name)
                    if probe is not None:
                        progress.findings(probe.findings())
                    if self.done % self.recipe.save_every == 0 and self.done < total:
                        self._save(metrics)
                if self.done > self.saved:
                    self._save(metrics)
        finally:
            progress.close()
            if probe is not None:
                probe.detach()
        finished = self.done == total
        exported = None
        if finished:
            if self.last_eval is None:  # resumed after the last step: evaluate for the summary
                self.last_eval = (self.done, self._evaluate())
            export(
                self.model,
                self.optimizer,
                self.out / EXPORT,
                dtype=self.recipe.export_dtype,
                policy=self.prec.policy,
                step=self.done,
            )
            exported = {"path": EXPORT, "dtype": self.recipe.export_dtype}
        findings = static + ([f.to_dict() for f in probe.findings()] if probe is not None else [])
        summary = strict_json(  # a non-finite number is null, as in the file
            self._summary(
                finished=finished,
                predicted=predicted,
                exported=exported,
                findings=findings,
            )
        )
        if self.rank == 0:
            write_json_atomic(self.out / SUMMARY_FILE, summary)
        if self.tracking is not None:
            self.tracking.finish(summary, (self.out / SUMMARY_FILE, self.out / RECIPE_FILE))
        return TrainResult(
            out=self.out,
            step=self.done,
            steps=total,
            finished=finished,
            checkpoint=None if self.latest is None else self.latest.path,
            summary=summary,
        )

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s batch: the global one, or this rank's contiguous share of it."""
        t = self.settings.train
        x, y = self.workload.train_batch(
            step=step, seed=self.recipe.seed, batch_size=t.batch_size, device=self.device
        )
        if self.world == 1:
            return x, y
        return x.chunk(self.world)[self.rank], y.chunk(self.world)[self.rank]

    def _mean_over_ranks(self, loss: torch.Tensor) -> float:
        if self.world == 1:
            return float(loss)
        t = loss.detach().float().reshape(1) / self.world
        torch.distributed.all_reduce(t)
        return float(t)

    def _step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        """Train step `step` (0-based) and return its metrics line."""
        t = self.settings.train
        lr = lr_at(step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = batch
        t0 = time.perf_counter()
        loss, report = training_step(
            self.workload,
            self.prec,
            self.model,
            self.optimizer,
            x,
            y,
            t,
            rng_seed=model_seed(self.recipe.seed, step, self.rank),
        )
        line: dict[str, Any] = {
            "step": step + 1,
            "loss": self._mean_over_ranks(loss),
            "lr": lr,
            "loss_scale": report.scale,
            "skipped": report.skipped,
            "grad_norm": report.grad_norm,
        }
        if step > self.start:  # not the first step of a call: it warms caches and kernels up
            self.step_time += time.perf_counter() - t0
            self.timed += 1
        self.done = step + 1
        if self.done % self.settings.eval_every == 0 or self.done == t.steps:
            result = self._evaluate()
            self.last_eval = (self.done, result)
            line["eval_loss"] = result.loss
            line["eval_metric"] = result.metric
        line["elapsed_s"] = round(self.elapsed(), 3)
        return line

    def _save(self, metrics: MetricsLog | NoMetrics) -> None:
        """A checkpoint after the last step done (the metrics file is synced first)."""
        from mixprec.checkpoint import save

        metrics.sync()
        self.latest = save(
            self.root,
            model=self.model,
            optimizer=self.optimizer,
            precision=self.prec,
            step=self.done,
            extra=self._extra(self.done, self.elapsed()),
            keep_last=self.recipe.keep_last,
        )
        self.saved = self.done
        if self.tracking is not None:
            self.tracking.checkpoint(self.latest.path)

    def _tracked(self) -> str | None:
        """Where the run is logged; None when not tracked or tracking failed."""
        if self.tracking is None or tracker_failed(self.tracker):
            return None
        return self.tracking.where or None

    def _track(self, start: int) -> TrainTracking:
        """The tracker run of this folder: a new one, or the one a resume goes on with."""
        assert self.tracker is not None
        tags = {
            "mixprec.command": "train",
            "mixprec.workload": self.workload.name,
            "mixprec.policy": self.prec.policy.name,
            "mixprec.out": str(self.out.resolve()),
        }
        params = {
            "policy": self.prec.policy.name,
            "policy_fields": self.prec.policy.to_dict(),
            "recipe": self.recipe.to_dict(),
            "settings": settings_dict(self.settings),
            "workload": self.workload.name,
            "workload_config": self.config,
            "world_size": self.world,
            "strategy": self.strategy or "none",
        }
        return TrainTracking(
            self.tracker,
            self.out,
            name=f"train-{self.workload.name}",
            start=start,
            params=params,
            tags=tags,
        )

    def elapsed(self) -> float:
        """Seconds of training so far, over every call of this run."""
        return self.elapsed_before + time.perf_counter() - self.began

    def _evaluate(self) -> EvalResult:
        return self.workload.evaluate(self.model, autocast=self.prec.autocast)

    def _header(self, start: int) -> str:
        size = self.workload.config.get("size")
        where = f"{self.workload.name}" + (f" ({size})" if size else "")
        text = (
            f"mixprec train: {where}, policy {self.prec.policy.name}, "
            f"optimizer {self.recipe.optimizer_label}, "
            f"{self.settings.train.steps} steps, seed {self.recipe.seed} -> {self.out}"
        )
        if start and self.latest is not None:
            text += f"; resuming from step {start} ({self.latest.path})"
        return text

    def _summary(
        self,
        *,
        finished: bool,
        predicted: dict[str, int],
        exported: dict[str, str] | None,
        findings: list[dict[str, Any]],
    ) -> dict[str, Any]:
        info = self.latest
        return {
            "status": "finished" if finished else "stopped",
            "workload": self.workload.name,
            "workload_description": self.workload.description,
            "workload_config": self.config,
            "metric_name": self.workload.metric_name,
            "higher_is_better": self.workload.higher_is_better,
            "policy": self.prec.policy.name,
            "policy_fields": self.prec.policy.to_dict(),
            "optimizer": self.recipe.optimizer_label,
            "seed": self.recipe.seed,
            "recipe": self.recipe.to_dict(),
            "settings": settings_dict(self.settings),
            "steps": self.settings.train.steps,
            "step": self.done,
            "steps_this_call": self.done - self.start,
            "final": None if self.last_eval is None else _final(*self.last_eval),
            "skipped_steps": self.prec.stats.skipped_steps,
            "loss_scale": self.prec.stats.loss_scale,
            "wall_time_s": self.elapsed(),
            "steps_per_s": self.timed / self.step_time if self.step_time else None,
            "world_size": self.world,
            "strategy": self.strategy,
            "checkpoint": None if info is None else _checkpoint(info, self.out),
            "export": exported,
            "predicted_bytes": predicted,
            "doctor": findings,
            "effective": self.prec.describe(),
            "tracked": self._tracked(),
        }


def _checkpoint(info: CheckpointInfo, out: Path) -> dict[str, Any]:
    path = str(info.path.relative_to(out))
    return {
        "path": path,
        "step": info.step,
        "bytes": info.bytes,
        "components": dict(info.components),
    }


def _final(step: int, result: EvalResult) -> dict[str, Any]:
    return {"step": step, "eval_loss": result.loss, "eval_metric": result.metric}
