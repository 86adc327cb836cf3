"""fp32 islands: which modules stay fp32 inside a 16-bit model, and how they run.

This module is the one home of the concept:

* the rule (`IslandRule`, from `Policy.fp32_modules`): module types, or fnmatch
  patterns matched against class names (any class in the MRO) and qualified
  names; norm layers by default;
* the names it picks in a model (`IslandRule.module_names`, `island_param_names`)
  and the names of the islands a model runs now (`island_names`);
* applying and removing islands (`add_fp32_islands`, `remove_fp32_islands`,
  `temporary_fp32_islands`).

Islands apply only under 16-bit parameter storage: there they keep fp32
parameters and run in fp32 (their floating inputs are upcast, autocast is off
inside, and the output goes back to the dtype of the first floating input, so the
16-bit model around the island sees the dtype it passed in). With fp32 storage,
autocast's own op lists decide.

An island is its module's instance ``forward``, a small picklable `Fp32Island`
object that runs the module's own forward in fp32 inside one ``with
torch.autocast(..., enabled=False)`` block; nothing else changes: the module's
class and torch are left alone, and ``state_dict`` keys do not change. So
``copy.deepcopy(model)`` (an EMA or teacher copy,
``torch.optim.swa_utils.AveragedModel``) gets islands of its own that use its
own parameters (the island refers to its module, and the copy maps it to the
copy), ``torch.save(model)`` works, and autocast is restored when the forward
raises. ``torch.compile`` traces the ``with`` block as one of its own autocast
contexts: no graph break, and a graph break inside the module's forward resumes
with autocast still off (a context entered in a forward pre-hook and left in a
forward hook, the earlier design, could not be traced at all).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.policy import DEFAULT_FP32_MODULES, Policy

__all__ = [
    "NORM_LAYERS",
    "Fp32Island",
    "IslandRule",
    "add_fp32_island",
    "add_fp32_islands",
    "is_fp32_island",
    "is_norm_layer",
    "island_names",
    "island_param_ids",
    "island_param_names",
    "matches_fp32_module",
    "remove_fp32_island",
    "remove_fp32_islands",
    "temporary_fp32_islands",
]

# ------------------------------------------------------------------ the rule


@dataclass(frozen=True)
class IslandRule:
    """Which modules of a model run as fp32 islands.

    Attributes:
        entries: module types, or fnmatch patterns matched against class names
            (any class in the MRO) and qualified module names
            (`Policy.fp32_modules`).
        active: whether islands apply at all: only under 16-bit parameter storage
            (with fp32 storage, autocast's op lists decide).
    """

    entries: tuple[type[nn.Module] | str, ...]
    active: bool = True

    @classmethod
    def of(cls, policy: Policy) -> IslandRule:
        """The rule of `policy`: its ``fp32_modules``, active under 16-bit storage."""
        return cls(tuple(policy.fp32_modules), active=policy.param_dtype != torch.float32)

    def matches(self, qualified_name: str, module: nn.Module) -> bool:
        """Whether `module` (at `qualified_name` in its model, ``""`` if unknown)
        matches the entries; `active` is not consulted."""
        for entry in self.entries:
            if isinstance(entry, type):
                if isinstance(module, entry):
                    return True
                continue
            if qualified_name and fnmatch.fnmatchcase(qualified_name, entry):
                return True
            if any(fnmatch.fnmatchcase(cls.__name__, entry) for cls in type(module).__mro__):
                return True
        return False

    def covers_class_name(self, class_name: str) -> bool:
        """Whether a module class named `class_name` matches, known by name only (a
        config that names no model): patterns match the name, types their own name."""
        return any(
            fnmatch.fnmatchcase(class_name, entry)
            if isinstance(entry, str)
            else entry.__name__ == class_name
            for entry in self.entries
        )

    def named_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The modules of `model` that become islands, with their qualified names
        (``""`` is the model itself); empty when the rule is not active."""
        if not self.active:
            return []
        return [
            (name, module) for name, module in model.named_modules() if self.matches(name, module)
        ]

    def module_names(self, model: nn.Module) -> tuple[str, ...]:
        """Qualified names of the modules of `model` that become islands."""
        return tuple(name for name, _ in self.named_modules(model))

    def describe(self) -> str:
        """One line such as ``*Norm, *Norm1d (16-bit storage: applied)``."""
        shown = ", ".join(e if isinstance(e, str) else e.__name__ for e in self.entries)
        state = "applied" if self.active else "not applied: fp32 storage"
        return f"{shown or 'none'} ({state})"


#: Norm layers, by the default patterns (`mixprec.policy.DEFAULT_FP32_MODULES`).
NORM_LAYERS = IslandRule(DEFAULT_FP32_MODULES)


def is_norm_layer(module: nn.Module) -> bool:
    """Whether `module` is a norm layer by class name (`NORM_LAYERS`)."""
    return NORM_LAYERS.matches("", module)


def matches_fp32_module(policy: Policy, qualified_name: str, module: nn.Module) -> bool:
    """Whether `module` (at `qualified_name` in its model) is one of the policy's fp32
    islands by `Policy.fp32_modules` (whatever the storage dtype)."""
    return IslandRule.of(policy).matches(qualified_name, module)


def island_param_names(model: nn.Module, policy: Policy) -> set[str]:
    """Qualified names of the parameters that stay fp32 under `policy`.

    Empty when the policy stores parameters in fp32 anyway (no islands apply).
    """
    names: set[str] = set()
    for mod_name, module in IslandRule.of(policy).named_modules(model):
        for p_name, _ in module.named_parameters():
            names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


# --------------------------------------------------------------- the hooks


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with its floating tensors cast to `dtype`, inside tuples, lists and dicts.

    Loops rather than comprehensions: this runs for every island at every forward, and
    each comprehension is a call of its own (before Python 3.12).
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        items = []
        for v in value:
            items.append(_cast_floating(v, dtype))
        return type(value)(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k] = _cast_floating(v, dtype)
        return out
    return value


class Fp32Island:
    """The forward of an fp32 island, set on its module as the instance ``forward``.

    A call upcasts floating inputs, runs the module's own forward (its class's, or
    an instance ``forward`` it already had) inside ``with torch.autocast(...,
    enabled=False)``, and casts floating outputs back to the dtype of the first
    floating input.

    Args:
        module: the island.
        device_type: the device type whose autocast is turned off inside.
    """

    def __init__(self, module: nn.Module, device_type: str) -> None:
        self.module = module
        self.device_type = device_type
        # What ran before: an instance forward set by someone else, or None (the class's).
        self.inner: Any = vars(module).get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        in_dtype = None  # of the first floating input
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                in_dtype = a.dtype
                break
        args, kwargs = _cast_floating(args, torch.float32), _cast_floating(kwargs, torch.float32)
        with torch.autocast(device_type=self.device_type, enabled=False):
            if self.inner is None:
                output = type(self.module).forward(self.module, *args, **kwargs)
            else:
                output = self.inner(*args, **kwargs)
        if output is not None and in_dtype is not None and in_dtype != torch.float32:
            return _cast_floating(output, in_dtype)
        return output


# ------------------------------------------------------ applying and removing


def is_fp32_island(module: nn.Module) -> bool:
    """Whether `module` runs as an fp32 island."""
    return isinstance(vars(module).get("forward"), Fp32Island)


def island_names(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of the modules of `model` that run as fp32 islands now."""
    return tuple(name for name, module in model.named_modules() if is_fp32_island(module))


def island_param_ids(model: nn.Module | None) -> frozenset[int]:
    """The ids of the parameters of the modules of `model` that run as fp32 islands now
    (none without a model)."""
    if model is None:
        return frozenset()
    return frozenset(id(p) for m in model.modules() if is_fp32_island(m) for p in m.parameters())


def add_fp32_island(module: nn.Module, device_type: str) -> None:
    """Make `module` an fp32 island (idempotent)."""
    if not is_fp32_island(module):
        module.forward = Fp32Island(module, device_type)


def remove_fp32_island(module: nn.Module) -> None:
    """Undo `add_fp32_island` (no-op for other modules)."""
    island = vars(module).get("forward")
    if not isinstance(island, Fp32Island):
        return
    if island.inner is None:
        del module.forward  # the class's forward shows again
    else:
        module.forward = island.inner


def add_fp32_islands(
    model: nn.Module, rule: Policy | IslandRule, device_type: str
) -> list[nn.Module]:
    """Make every module of `model` that the rule (or the policy's) names an island.

    Nothing happens when the rule is not active (fp32 storage). Returns the
    modules that became islands now (existing islands are kept and not listed).
    """
    rule = rule if isinstance(rule, IslandRule) else IslandRule.of(rule)
    added: list[nn.Module] = []
    for _name, module in rule.named_modules(model):
        if not is_fp32_island(module):
            add_fp32_island(module, device_type)
            added.append(module)
    return added


def remove_fp32_islands(model: nn.Module) -> tuple[str, ...]:
    """Remove every fp32 island from `model`; returns the names of those removed.

    Parameter dtypes are left as they are (casting them is `Precision.prepare`'s
    job); the modules run their plain ``forward`` again.
    """
    removed = [(name, module) for name, module in model.named_modules() if is_fp32_island(module)]
    for _name, module in removed:
        remove_fp32_island(module)
    return tuple(name for name, _ in removed)


@contextlib.contextmanager
def temporary_fp32_islands(
    model: nn.Module, rule: Policy | IslandRule, device_type: str
) -> Iterator[None]:
    """The rule's (or the policy's) islands in `model` for the duration of the context
    (for predictions that run a model as `Precision.prepare` would leave it). Islands
    that already existed are kept."""
    added = add_fp32_islands(model, rule, device_type)
    try:
        yield
    finally:
        for module in added:
            remove_fp32_island(module)
