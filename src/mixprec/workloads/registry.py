"""Finding a workload by name: the built-ins, or a user's `module:function`.

`load_workload("shakespeare", size="tiny")` builds a built-in workload.
`load_workload("my_pkg.tasks:make_task", width=64)` imports `my_pkg.tasks` and
calls `make_task(width=64)`, which must return a `Workload`.

Importing a module runs its code. That is fine when a person asks for it (a
`--workload` flag, a Python call) but not when a config file asks: a config
file copied from elsewhere must never run code. Callers that resolve specs
found in files pass `allow_import=False`, which accepts built-in names only.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType

from mixprec.errors import UserCodeError
from mixprec.workloads.base import Workload
from mixprec.workloads.digits import digits_workload
from mixprec.workloads.shakespeare import shakespeare_workload

__all__ = ["WORKLOADS", "load_workload", "workload_names"]

#: Built-in workload factories by name; each takes `size=` and config overrides.
WORKLOADS: Mapping[str, Callable[..., Workload]] = MappingProxyType(
    {"digits": digits_workload, "shakespeare": shakespeare_workload}
)

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def workload_names() -> tuple[str, ...]:
    """Names of the built-in workloads, sorted."""
    return tuple(sorted(WORKLOADS))


def load_workload(spec: str, *, allow_import: bool = True, **overrides: object) -> Workload:
    """Build the workload named by `spec`.

    Args:
        spec: A built-in name (see `workload_names()`), or `"module:function"`
            naming an importable module and a callable in it (dotted
            attributes allowed) that returns a `Workload`.
        allow_import: Whether a `module:function` spec may import code. Pass
            False when the spec comes from a config file.
        **overrides: Keyword arguments for the factory (for built-ins, `size`
            and fields of their config, e.g. `size="tiny"` or `n_layer=2`).

    Raises:
        ValueError: Unknown name, malformed spec, a module or attribute that
            does not exist, or an import that `allow_import=False` forbids.
        TypeError: The target is not callable or does not return a `Workload`.
    """
    if not isinstance(spec, str):
        raise TypeError(f"workload spec must be a str, got {type(spec).__name__}")
    if spec in WORKLOADS:
        return WORKLOADS[spec](**overrides)
    if ":" not in spec:
        close = difflib.get_close_matches(spec, WORKLOADS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown workload {spec!r}{hint}; built-in: {', '.join(workload_names())}; "
            "or a user workload as 'module:function', e.g. 'my_pkg.tasks:make_workload'"
        )
    module_name, _, attr_path = spec.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr_path):
        raise ValueError(
            f"malformed workload spec {spec!r}; expected 'module:function' with dotted Python "
            f"names, e.g. 'my_pkg.tasks:make_workload', or a built-in: "
            f"{', '.join(workload_names())}"
        )
    if not allow_import:
        raise ValueError(
            f"workload {spec!r} would import {module_name!r}, which is not allowed here "
            "(specs read from config files may only name built-ins: "
            f"{', '.join(workload_names())}); pass it explicitly, e.g. on the command line"
        )
    factory = _import_attr(module_name, attr_path, spec=spec)
    if not callable(factory):
        raise TypeError(f"workload {spec!r} is a {type(factory).__name__}, not a callable")
    try:
        workload = factory(**overrides)
    except Exception as exc:  # the user's code: keep its type and message in one line
        raise UserCodeError(
            f"workload {spec!r} raised {type(exc).__name__}: {exc}".rstrip(": ")
        ) from exc
    if not isinstance(workload, Workload):
        raise TypeError(
            f"workload factory {spec!r} returned {type(workload).__name__}; "
            "it must return a mixprec.workloads.Workload"
        )
    return workload


def _import_attr(module_name: str, attr_path: str, *, spec: str) -> object:
    try:
        target: object = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only a missing target module is the spec's fault; a missing import
        # inside the user's module is their bug and propagates unchanged.
        if error.name is None or not (
            module_name == error.name or module_name.startswith(error.name + ".")
        ):
            raise
        raise ValueError(
            f"workload {spec!r}: cannot import module {module_name!r} ({error}); "
            "is it installed or on sys.path (PYTHONPATH)?"
        ) from error
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ValueError(f"workload {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    return target
