"""The optimizer a run trains with: a name and keyword arguments (`compare` and `train`).

A contract (or a training recipe) names the optimizer by `OPTIMIZERS` key and gives
it keyword arguments (``optimizer: lion``, ``optimizer_args: {lr: 3e-4}``; on the
command line ``--optimizer lion --optimizer-args lr=3e-4``). Both are checked once,
here, before any run starts: the name, every key against the class's signature,
every value by building the optimizer once on a throwaway parameter.

The learning rate, weight decay and betas are training settings (`TrainSettings`):
the schedule sets the learning rate at every step, and a checkpoint records them.
Given in the optimizer's arguments they are moved into the contract's training
overrides (``optimizer_args: {lr: 0.1}`` is ``lr: 0.1``), so the same run is the
same contract however it was written. The workload's own settings were tuned for
AdamW; `resolve_train` says which of them carry over to another optimizer (only
those that mean the same thing there) and which the optimizer's own default
replaces. See docs/compare.md ("The optimizer").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mixprec.engine import Precision
from mixprec.optim import OPTIMIZERS, Lion
from mixprec.workloads.settings import TrainSettings, lr_at

__all__ = [
    "DEFAULT_OPTIMIZER",
    "LION_LR_DIVISOR",
    "OPTIMIZERS",
    "TRAIN_ARGS",
    "build_optimizer",
    "check_optimizer",
    "optimizer_label",
    "parse_optimizer_args",
    "resolve_train",
    "takes_betas",
]


#: The optimizer of a contract that names none (the one every contract before
#: `optimizer` existed trained with).
DEFAULT_OPTIMIZER = "adamw"

#: Arguments that are training settings: given to the optimizer, they go to the
#: contract's training overrides (the schedule sets ``lr`` at every step).
TRAIN_ARGS: tuple[str, ...] = ("lr", "weight_decay", "betas")

#: Lion's learning rate, when none is given, is the workload's (AdamW's) divided by
#: this, and its weight decay multiplied by it: Chen et al. 2023 ("Symbolic Discovery
#: of Optimization Algorithms", section 5) advise a learning rate 3-10x smaller than
#: AdamW's, as Lion's sign update has a larger norm, and a weight decay 3-10x larger so
#: that the decay per step (lr x weight decay) stays AdamW's.
LION_LR_DIVISOR = 3.0

#: torch's options no mixprec optimizer honours (each class refuses them, naming why).
_UNSUPPORTED = ("differentiable", "capturable")

#: Arguments the run decides, with what decides them.
_DECIDED = {
    "params": "the run gives the model's parameters",
    "master": "the policy decides the master: choose a policy that keeps the one you want "
    "(e.g. bf16_master)",
    "moments": "the policy decides the moment format: choose a policy that keeps the one "
    "you want (e.g. bf16_lean)",
    "seed": "the run's seed sets it (train --seed; compare runs --seeds N seeds)",
}


def optimizer_label(name: str, args: Mapping[str, Any]) -> str:
    """``sgd (momentum=0.9)``, ``adamw``: how reports and records name an optimizer."""
    if not args:
        return name
    inner = ", ".join(f"{k}={_text(v)}" for k, v in sorted(args.items()))
    return f"{name} ({inner})"


def parse_optimizer_args(text: object) -> dict[str, Any]:
    """``k=v[,k=v]`` (the command line's ``--optimizer-args``), or a mapping (a contract
    file), as keyword arguments.

    Values are read as data, never evaluated: ``true``/``false``, ``none``, integers,
    floats (``3e-4``), and tuples of those in parentheses or brackets
    (``betas=(0.9,0.95)``). Other text stays text, which `check_optimizer` refuses
    (after the key: an unknown key is named first).

    Raises:
        ValueError: not ``key=value`` pairs, a key given twice, or a value that is not
            finite, naming it.
    """
    if isinstance(text, Mapping):
        return {str(k): _value(str(k), v) for k, v in text.items()}
    if not isinstance(text, str):
        raise ValueError(
            f"optimizer_args {text!r} is not key=value pairs: give e.g. momentum=0.9,nesterov=true"
        )
    out: dict[str, Any] = {}
    for item in _split_top(text):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(
                f"optimizer_args item {item.strip()!r} is not key=value: write e.g. "
                "--optimizer-args momentum=0.9,lr=0.05"
            )
        if key in out:
            raise ValueError(f"optimizer_args gives {key!r} twice: give it once")
        out[key] = _value(key, raw.strip())
    return out


def check_optimizer(
    name: object, args: Mapping[str, Any], train: Mapping[str, Any]
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The optimizer of a contract or recipe, checked: its name, its own arguments, and
    the training overrides with the arguments that are training settings moved in.

    Args:
        name: an `OPTIMIZERS` key (any case).
        args: keyword arguments (`parse_optimizer_args` already applied).
        train: the contract's training overrides (checked by `TrainSettings`).

    Returns:
        ``(name, args without TRAIN_ARGS, train overrides with them)``.

    Raises:
        ValueError: an unknown name, a key the class does not take or the run decides,
            a value the class refuses, a training setting given twice with two values,
            betas for an optimizer without them, or SGD without a learning rate; one
            line naming the value and the fix.
    """
    if not isinstance(name, str) or name.strip().lower() not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    name = name.strip().lower()
    cls = OPTIMIZERS[name]
    takes = _keywords(cls)
    for key, value in args.items():
        if key in _DECIDED:
            raise ValueError(
                f"optimizer_args {key!r} is not an optimizer setting here: {_DECIDED[key]}"
            )
        if key not in takes:
            valid = sorted(k for k in takes - set(_DECIDED) if k not in _UNSUPPORTED)
            raise ValueError(
                f"optimizer_args {key!r} is not an argument of {name} "
                f"(mixprec.optim.{cls.__name__}); valid: {', '.join(valid)}"
            )
        if isinstance(value, str) or (
            isinstance(value, tuple) and any(isinstance(v, str) for v in value)
        ):
            raise ValueError(_bad(key, value))
    merged = dict(train)
    for key in TRAIN_ARGS:
        if key not in args:
            continue
        value = list(args[key]) if isinstance(args[key], tuple) else args[key]
        held = train.get(key)
        if held is not None and _plain(held) != _plain(value):
            raise ValueError(
                f"{key} is given twice, {_text(held)} as a training setting and "
                f"{_text(value)} in optimizer_args: give it once"
            )
        merged[key] = value
    merged = TrainSettings.check_overrides(merged)
    own = {k: v for k, v in args.items() if k not in TRAIN_ARGS}
    if "betas" in merged and "betas" not in takes:
        raise ValueError(
            f"betas {_text(merged['betas'])} is set, but {name} takes no betas: remove it, "
            f"or choose an optimizer with betas ({', '.join(_with('betas'))})"
        )
    if name == "sgd" and "lr" not in merged:
        raise ValueError(
            "optimizer sgd needs a learning rate: its step is lr x gradient, unlike AdamW's "
            "normalized step, so the workload's AdamW lr does not carry over; give one, e.g. "
            "--optimizer-args lr=0.05,momentum=0.9 (or --lr)"
        )
    _try_build(name, cls, own, merged)
    return name, own, merged


def resolve_train(
    defaults: TrainSettings, overrides: Mapping[str, object], optimizer: str
) -> TrainSettings:
    """The training settings of a run of `optimizer`: the workload's `defaults`, adapted
    to the optimizer, with the contract's `overrides`.

    The workload's settings were tuned for AdamW. For ``adamw`` they apply as they are.
    For the others a setting carries over only where it means the same thing:

    * ``adam``: lr and betas carry over; weight decay is Adam's L2 penalty (added to the
      gradient), not AdamW's decoupled decay, so it is 0 (torch's default) unless given.
    * ``lion``: lr and min_lr are divided by `LION_LR_DIVISOR`, weight decay (decoupled,
      as AdamW's) multiplied by it; betas are Lion's own (0.9, 0.99) unless given.
    * ``sgd``: the lr must be given (`check_optimizer`); weight decay is SGD's L2
      penalty, 0 unless given; betas do not apply (SGD takes none: the field is kept
      for the schedule's record, never passed).

    For sgd and lion, whose lr is not AdamW's, a given lr without a min_lr keeps the
    workload's min_lr/lr ratio (the cosine decay keeps its shape).

    Raises:
        ValueError: the result is no valid schedule (`TrainSettings.with_overrides`).
    """
    d = defaults
    if optimizer == "adam":
        d = replace(d, weight_decay=0.0)
    elif optimizer == "lion":
        betas = inspect.signature(Lion).parameters["betas"].default
        d = replace(
            d,
            lr=d.lr / LION_LR_DIVISOR,
            min_lr=d.min_lr / LION_LR_DIVISOR,
            weight_decay=d.weight_decay * LION_LR_DIVISOR,
            betas=tuple(betas),
        )
    elif optimizer == "sgd":
        d = replace(d, weight_decay=0.0)
    lr = overrides.get("lr")
    if optimizer in ("sgd", "lion") and lr is not None and overrides.get("min_lr") is None:
        assert isinstance(lr, float)
        d = replace(d, lr=lr, min_lr=lr * (defaults.min_lr / defaults.lr))
    return d.with_overrides(overrides)


def build_optimizer(
    prec: Precision,
    model: nn.Module,
    name: str,
    args: Mapping[str, Any],
    train: TrainSettings,
    *,
    seed: int | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `name` over `model` under `prec`'s plan, registered with it
    (`Precision.optimizer`: the plan's param groups, master and moment format), with
    the learning rate of step 0, the run's weight decay and (where the class takes
    them) betas, and `args`. ``adamw`` is what ``prec.optimizer(model, lr=, betas=,
    weight_decay=)`` builds."""
    cls = OPTIMIZERS[name]
    kwargs = dict(args, weight_decay=train.weight_decay)
    if "betas" in _keywords(cls):
        kwargs["betas"] = train.betas
    if seed is not None:
        kwargs["seed"] = seed
    return prec.optimizer(model, lr_at(0, train), optimizer=cls, **kwargs)


def takes_betas(name: str) -> bool:
    """Whether the optimizer `name` takes betas (SGD does not)."""
    return "betas" in _keywords(OPTIMIZERS[name])


def _keywords(cls: type) -> set[str]:
    return set(inspect.signature(cls).parameters) - {"self"}


def _with(arg: str) -> list[str]:
    return [n for n, c in OPTIMIZERS.items() if arg in _keywords(c)]


def _try_build(name: str, cls: type, own: Mapping[str, Any], train: Mapping[str, Any]) -> None:
    """Build the optimizer once on a throwaway fp32 parameter: its own checks judge the
    values (before any run starts, not at the first one)."""
    probe = [torch.zeros(1, requires_grad=True)]
    kwargs: dict[str, Any] = {k: v for k, v in train.items() if k in TRAIN_ARGS}
    if "betas" not in _keywords(cls):
        kwargs.pop("betas", None)
    try:
        cls(probe, **own, **kwargs, master="none", moments="fp32")
    except (ValueError, TypeError, RuntimeError) as exc:
        shown = ",".join(f"{k}={_text(v)}" for k, v in own.items()) or "none"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"optimizer {name} refuses its arguments ({shown}): {first}; fix the value in "
            "--optimizer-args"
        ) from None


def _split_top(text: str) -> list[str]:
    """`text` split at commas outside parentheses and brackets; empty items dropped."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


def _value(key: str, raw: object) -> Any:
    """One argument's value as data: bool, None, int, float or a tuple of them."""
    if raw is None or isinstance(raw, bool | int | float):
        return _finite(key, raw)
    if isinstance(raw, list | tuple):
        return tuple(_scalar(key, v) for v in raw)
    if isinstance(raw, str):
        text = raw.strip()
        if text[:1] in "([" and text[-1:] in ")]":
            return tuple(_scalar(key, v) for v in _split_top(text[1:-1]))
        return _scalar(key, text)
    raise ValueError(_bad(key, raw))


def _scalar(key: str, raw: object) -> Any:
    if raw is None or isinstance(raw, bool | int | float):
        return _finite(key, raw)
    text = str(raw).strip()
    words = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return _finite(key, kind(text))
        except ValueError:
            continue
    return text  # no value any optimizer takes: refused once the key is known


def _finite(key: str, value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"optimizer_args {key}={value!r} is not a finite number: give one")
    return value


def _bad(key: str, raw: object) -> str:
    shown = _text(raw) if isinstance(raw, tuple) else repr(raw)
    return (
        f"optimizer_args {key}={shown} is not a number, true/false, none or a tuple of "
        "those: e.g. momentum=0.9, nesterov=true, betas=(0.9,0.95)"
    )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [float(v) for v in value]
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "(" + ",".join(_text(v) for v in value) + ")"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)
