"""The plan of an experiment: what every run does, resolved before anything trains.

Pure functions of the contract, the workload and the device: the settings of a
run (the contract's training overrides over the workload's `TrainSettings`, and
the contract's cadences), the keyword arguments the workload is built with,
which candidates stop early, and when held-out evaluations happen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mixprec.device import device_caps
from mixprec.experiment.contract import Contract
from mixprec.experiment.summary import tail_start
from mixprec.policy import policy as get_policy
from mixprec.workloads import Workload
from mixprec.workloads.settings import TrainSettings

__all__ = [
    "RunSettings",
    "RunSpec",
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

    def __post_init__(self) -> None:
        if not isinstance(self.train, TrainSettings):
            raise TypeError(f"train must be a TrainSettings, got {type(self.train).__name__}")
        for name in ("eval_every", "probe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (steps), got {value!r}")


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


def settings_for(contract: RunSpec, workload: Workload) -> RunSettings:
    """The contract's settings for `workload`: its `train` overrides win over the
    workload's defaults (`TrainSettings.with_overrides`), cadences from the contract.

    Raises:
        ValueError: the overrides and the defaults together make no valid schedule
            (e.g. an overridden `lr` below the workload's `min_lr`).
    """
    return RunSettings(
        train=workload.defaults.with_overrides(contract.train),
        eval_every=contract.eval_every,
        probe_every=contract.probe_every,
    )


def settings_dict(settings: RunSettings) -> dict[str, Any]:
    """`settings` as the flat JSON stored in contract.json and results.json.

    The training fields, then the cadences, then `betas` (the order files of
    RECORD_VERSION 3 have).
    """
    train = settings.train.to_dict()
    betas = train.pop("betas")
    return {
        **train,
        "eval_every": settings.eval_every,
        "probe_every": settings.probe_every,
        "betas": betas,
    }


def workload_options(contract: RunSpec) -> dict[str, str]:
    """The keyword arguments the workload of a contract (or recipe) is built with."""
    if contract.size is not None:
        return {"size": contract.size}
    if contract.workload == "shakespeare":
        return {"size": "compare"}
    return {}


def step_caps_for(contract: Contract, steps: int, device: str) -> dict[str, int]:
    """The step at which each capped policy stops (see `Contract.step_caps`)."""
    if contract.step_caps is not None:
        return {name: min(cap, steps) for name, cap in contract.step_caps.items()}
    if device_caps(device).fp16_fast:
        return {}
    return {
        name: max(1, steps // 5)
        for name in contract.candidates
        if get_policy(name).compute_dtype == torch.float16
    }


def evaluation_steps(steps: int, caps: dict[str, int]) -> frozenset[int]:
    """Extra held-out evaluations: every compared step and the start of its last fifth
    (the decision's training-length check reads the baseline's improvement there)."""
    compared = {steps, *caps.values()}
    return frozenset({*compared, *(tail_start(c) for c in compared)} - {0})
