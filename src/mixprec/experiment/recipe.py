"""The training recipe: one long run of one policy on one workload (`mixprec train`).

A recipe is plain data in the same dict form as a compare `Contract`: the same
``workload``, ``size``, ``eval_every`` and ``probe_every`` keys, and the
`TrainSettings` fields as top-level keys (``steps: 2000``, ``lr: 1e-3``), read
by the same function (`contract.split_train_keys`). It adds what only a long
run needs: the ``policy``, the ``seed``, how often and how many checkpoints are
kept, and the dtype of the exported weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.dtypes import dtype_name, parse_dtype
from mixprec.experiment.contract import canonical_policy, split_train_keys
from mixprec.experiment.optimizer import (
    DEFAULT_OPTIMIZER,
    check_optimizer,
    optimizer_label,
    parse_optimizer_args,
)
from mixprec.workloads.settings import TrainSettings

__all__ = ["EXPORT_DTYPES", "Recipe"]

#: The dtypes `export_dtype` may name (canonical short names).
EXPORT_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One training run, as `mixprec train` (or `mixprec.train`) runs it.

    Raises:
        ValueError: a field out of range, naming the value and what would be valid.
    """

    policy: str
    """The precision policy (a preset name or alias; an alias is stored as its preset)."""
    workload: str = "shakespeare"
    """A built-in workload name (or ``module:function`` from the command line; never
    from a file)."""
    size: str | None = None
    """The workload's size preset; None: as in a contract (``compare`` for
    shakespeare, the workload's own default otherwise)."""
    seed: int = 0
    """Fixes the initial weights and the order of the batches."""
    train: Mapping[str, object] = field(default_factory=dict)
    """Overrides of the workload's `TrainSettings`, by field name (top-level keys in
    the dict form, as in a contract)."""
    eval_every: int = 100
    """Steps between held-out evaluations (the last step is always evaluated)."""
    probe_every: int = 25
    """Steps between the doctor's runtime probe samples."""
    save_every: int = 100
    """Steps between checkpoints (the last step and a stop always save one)."""
    keep_last: int | None = 3
    """How many newest checkpoints are kept (None: all)."""
    export_dtype: str = "fp32"
    """The dtype of the exported weights: fp32, bf16 or fp16."""
    optimizer: str = DEFAULT_OPTIMIZER
    """The optimizer, by name (``adamw``, ``adam``, ``sgd``, ``lion``), as in a contract
    (`mixprec.experiment.optimizer`)."""
    optimizer_args: Mapping[str, Any] = field(default_factory=dict)
    """Its keyword arguments; ``lr``, ``weight_decay`` and ``betas`` are moved to `train`."""

    def __post_init__(self) -> None:
        for name in ("workload", "policy"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.size is not None and not isinstance(self.size, str):
            raise ValueError(f"size must be a string (e.g. tiny) or null, got {self.size!r}")
        object.__setattr__(self, "policy", canonical_policy(self.policy))
        object.__setattr__(self, "train", TrainSettings.check_overrides(self.train))
        name, args, train = check_optimizer(
            self.optimizer, parse_optimizer_args(self.optimizer_args), self.train
        )
        object.__setattr__(self, "optimizer", name)
        object.__setattr__(self, "optimizer_args", args)
        object.__setattr__(self, "train", train)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        for name in ("eval_every", "probe_every", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (steps), got {value!r}")
        keep = self.keep_last
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep_last must be an int >= 1 or null (keep all), got {keep!r}")
        object.__setattr__(self, "export_dtype", _export_dtype(self.export_dtype))

    @property
    def steps(self) -> int | None:
        """The overridden number of steps, None when the workload's default is kept."""
        steps = self.train.get("steps")
        return steps if isinstance(steps, int) else None

    @property
    def optimizer_label(self) -> str:
        """The optimizer and its own arguments (``sgd (momentum=0.9)``)."""
        return optimizer_label(self.optimizer, self.optimizer_args)

    def to_dict(self) -> dict[str, Any]:
        """The dict form (`from_dict` reads it back): `train` overrides as top-level keys;
        the optimizer only when it is not the default AdamW without arguments (the
        recipes of before read and write back unchanged)."""
        out: dict[str, Any] = {}
        default = self.optimizer == DEFAULT_OPTIMIZER and not self.optimizer_args
        for f in dataclasses.fields(self):
            if f.name == "train":
                out.update({k: _plain(v) for k, v in self.train.items()})
            elif f.name == "optimizer_args":
                if not default:
                    out[f.name] = {k: _plain(v) for k, v in sorted(self.optimizer_args.items())}
            elif f.name != "optimizer" or not default:
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Build from plain data (a YAML mapping); unknown keys raise, naming the valid ones.

        Raises:
            ValueError: an unknown key, a missing policy, or a bad value.
        """
        values = split_train_keys(
            data,
            fields=[f.name for f in dataclasses.fields(cls)],
            int_fields=("seed", "eval_every", "probe_every", "save_every", "keep_last"),
            what="recipe",
        )
        if values.get("policy") is None:
            raise ValueError(
                "the recipe names no policy: give one (policy: bf16_master, --policy, or "
                "--policy-from a compare folder)"
            )
        return cls(**values)


def _plain(value: object) -> object:
    # A non-finite float as text (`grad_clip_norm: inf`): recipe.json is strict JSON,
    # where it would become null, which reads back as "not overridden".
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return list(value) if isinstance(value, tuple) else value


def _export_dtype(value: object) -> str:
    bad = ValueError(f"export_dtype must be one of {', '.join(EXPORT_DTYPES)}, got {value!r}")
    if not isinstance(value, str | torch.dtype):
        raise bad
    try:
        name = dtype_name(parse_dtype(value))
    except ValueError:
        raise bad from None
    if name not in EXPORT_DTYPES:
        raise bad
    return name
