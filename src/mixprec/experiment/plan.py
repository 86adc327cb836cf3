"""The plan of an experiment: what every run does, resolved before anything trains.

Pure functions of the contract, the workload and the device: the default
candidates a device can judge, the settings of a run (the contract's training
overrides over the workload's `TrainSettings`, and the contract's cadences), the
keyword arguments the workload is built with, which candidates stop early, and
when held-out evaluations happen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mixprec.device import device_caps
from mixprec.experiment.contract import DEFAULT_CANDIDATES, Contract
from mixprec.experiment.optimizer import (
    DEFAULT_OPTIMIZER,
    OPTIMIZERS,
    optimizer_label,
    resolve_train,
    takes_betas,
)
from mixprec.experiment.summary import tail_start
from mixprec.policy import preset
from mixprec.workloads import Workload
from mixprec.workloads.settings import TrainSettings

__all__ = [
    "MIN_CURVE_POINTS",
    "RunSettings",
    "RunSpec",
    "curve_every",
    "default_candidates",
    "evaluation_steps",
    "settings_dict",
    "settings_for",
    "step_caps_for",
    "workload_options",
]


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The resolved settings of one run: how it trains, and how often it is observed.

    `train` is the only training schema (`TrainSettings`). The two cadences stay
    outside it because they say when a run is looked at, not what it computes:
    held-out evaluations run without gradients and restore the model's modes, and
    probes observe. They come from the contract alone; a workload has no say in
    them.
    """

    train: TrainSettings
    """The workload's training settings with the contract's overrides applied."""
    eval_every: int
    """Steps between held-out evaluations for the curves (the final one always runs)."""
    probe_every: int
    """Steps between the doctor's runtime probe samples."""
    optimizer: str = DEFAULT_OPTIMIZER
    """The optimizer the run trains with (an `optimizer.OPTIMIZERS` name)."""
    optimizer_args: Mapping[str, Any] = field(default_factory=dict)
    """Its own keyword arguments (the training settings lr, weight decay and betas come
    from `train`)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not isinstance(self.train, TrainSettings):
            raise TypeError(f"train must be a TrainSettings, got {type(self.train).__name__}")
        for name in ("eval_every", "probe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (steps), got {value!r}")

    def check_release(self, policies: Iterable[str]) -> None:
        """Refuse a policy that releases gradients (`Policy.release_gradients`) in runs
        that clip them by a finite global norm: it steps each parameter during backward,
        before that norm exists (docs/release.md). Checked before any run trains."""
        clip = self.train.grad_clip_norm
        if clip is None or math.isinf(clip):
            return  # (inf clips nothing: `training_step` leaves such policies unclipped)
        released = [name for name in policies if preset(name).release_gradients]
        if released:
            raise ValueError(
                f"{', '.join(released)}: gradients released during backward, before their "
                f"global norm exists, so grad_clip_norm={clip} cannot apply: set "
                "`grad_clip_norm: .inf` (clips nothing) in a --config file, or train a "
                "policy that keeps gradients (e.g. bf16_lean)"
            )


class RunSpec(Protocol):
    """What a run is made of, as a `Contract` or a training `Recipe` names it."""

    @property
    def workload(self) -> str: ...
    @property
    def size(self) -> str | None: ...
    @property
    def train(self) -> Mapping[str, object]: ...
    @property
    def eval_every(self) -> int: ...
    @property
    def probe_every(self) -> int: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def optimizer_args(self) -> Mapping[str, Any]: ...


def settings_for(contract: RunSpec, workload: Workload) -> RunSettings:
    """The contract's settings for `workload`: its `train` overrides win over the
    workload's defaults as they apply to the contract's optimizer
    (`optimizer.resolve_train`), cadences and the optimizer from the contract.

    Raises:
        ValueError: the overrides and the defaults together make no valid schedule
            (e.g. an overridden `lr` below the workload's `min_lr`).
    """
    return RunSettings(
        train=resolve_train(workload.defaults, contract.train, contract.optimizer),
        eval_every=contract.eval_every,
        probe_every=contract.probe_every,
        optimizer=contract.optimizer,
        optimizer_args=dict(contract.optimizer_args),
    )


def settings_dict(settings: RunSettings) -> dict[str, Any]:
    """`settings` as the flat JSON stored in contract.json and results.json.

    The training fields, then the cadences, then `betas` (the order files of
    RECORD_VERSION 3 have; left out for an optimizer that takes none), then the
    optimizer with its own arguments (``sgd (momentum=0.9)``) unless it is the default
    AdamW without any.
    """
    train = settings.train.to_dict()
    betas = train.pop("betas")
    out = {**train, "eval_every": settings.eval_every, "probe_every": settings.probe_every}
    if takes_betas(settings.optimizer):
        out["betas"] = betas
    label = optimizer_label(settings.optimizer, settings.optimizer_args)
    if label != DEFAULT_OPTIMIZER:  # files of AdamW runs stay as they were
        out["optimizer"] = label
    return out


def workload_options(contract: RunSpec) -> dict[str, str]:
    """The keyword arguments the workload of a contract (or recipe) is built with."""
    if contract.size is not None:
        return {"size": contract.size}
    if contract.workload == "shakespeare":
        return {"size": "compare"}
    return {}


def default_candidates(contract: Mapping[str, Any], device: str) -> tuple[dict[str, Any], str]:
    """The dict form of a contract with the candidates `compare` tries on `device` when
    it names none, and a note naming those left out ("" when none are).

    When `contract` names neither ``candidates`` nor ``step_caps``, the
    fp16-compute presets of `DEFAULT_CANDIDATES` are left out where fp16 matmuls
    are not accelerated (`mixprec.device_caps(device).fp16_fast` false): there
    they would stop at a fifth of the steps (`step_caps_for`) and end too short to
    judge. Named explicitly they still run, capped. The `Contract` built from the
    result is device-independent data: it lists the candidates that ran.
    """
    caps = device_caps(device)
    if "candidates" in contract or contract.get("step_caps") is not None or caps.fp16_fast:
        return dict(contract), ""
    fp16 = [n for n in DEFAULT_CANDIDATES if preset(n).compute_dtype == torch.float16]
    kept = [n for n in DEFAULT_CANDIDATES if n not in fp16]
    note = (
        f"{', '.join(fp16)} left out of the default candidates: fp16 matmul is not "
        f"accelerated on {caps.name}, so they would stop at a fifth of the steps, too "
        "short to judge; name them (--policies, policies=) to run them capped"
    )
    return {**contract, "candidates": kept}, note


def step_caps_for(contract: Contract, steps: int, device: str) -> dict[str, int]:
    """The step at which each capped policy stops (see `Contract.step_caps`)."""
    if contract.step_caps is not None:
        return {name: min(cap, steps) for name, cap in contract.step_caps.items()}
    if device_caps(device).fp16_fast:
        return {}
    return {
        name: max(1, steps // 5)
        for name in contract.candidates
        if preset(name).compute_dtype == torch.float16
    }


#: The fewest held-out evaluations after step 0 that draw a run's curve.
MIN_CURVE_POINTS = 5


def curve_every(steps: int, eval_every: int) -> int:
    """Steps between the held-out evaluations of a run's curve: `eval_every`, or less
    when that would leave fewer than `MIN_CURVE_POINTS` points (a run of 60 steps
    with ``eval_every: 100`` is evaluated every 12 steps)."""
    return max(1, min(eval_every, steps // MIN_CURVE_POINTS))


def evaluation_steps(
    steps: int, caps: dict[str, int], eval_every: int | None = None
) -> frozenset[int]:
    """Extra held-out evaluations: every compared step and the start of its last fifth
    (the decision's training-length check reads the baseline's improvement there),
    and, given `eval_every`, the curve's points (`curve_every`), so that a run shorter
    than a few `eval_every` still draws a curve. Evaluations run without gradients and
    restore the model's modes: they never change what a run trains."""
    compared = {steps, *caps.values()}
    points = {*compared, *(tail_start(c) for c in compared)}
    if eval_every is not None:
        every = curve_every(steps, eval_every)
        points |= set(range(every, steps, every))
    return frozenset(points - {0})
