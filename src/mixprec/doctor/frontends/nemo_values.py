"""NeMo AutoModel recipe values, read as NeMo's own loader reads them.

NeMo AutoModel's ``ConfigNode`` (``nemo_automodel/components/config/loader.py``,
NVIDIA-NeMo/Automodel, Apache-2.0) wraps every scalar of a parsed recipe:
``_target_`` and keys ending in ``_fn`` are resolved as import paths; every other
string first has environment references resolved (``${VAR}``, ``${VAR,default}``,
``${oc.env:VAR}``, ``$VAR``, in `resolve_yaml_env_vars`) and then goes through
``translate_value``: the strings ``None``/``none`` become None, ``true``/``True``
and ``false``/``False`` booleans, then ``ast.literal_eval`` is tried (numbers,
lists, dicts, tuples), strings over 1000 characters and anything that does not
parse stay strings.

`translate_value` does the same here: ``ast.literal_eval`` evaluates literals
only, so nothing in a recipe is executed. Environment references depend on the
machine that runs the recipe, so they are never guessed: a string holding one
becomes `Unresolved`, which the front end reports as unknown.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixprec.doctor.frontends.document import ConfigDoc

__all__ = [
    "NEMO_SYMBOLS",
    "UnknownValueError",
    "Unresolved",
    "nemo_view",
    "translate_value",
    "unresolved_paths",
]

#: The strings NeMo's ``translate_value`` maps before trying ``ast.literal_eval``.
NEMO_SYMBOLS: Mapping[str, Any] = {
    "none": None,
    "None": None,
    "true": True,
    "True": True,
    "false": False,
    "False": False,
}

#: Longest string NeMo passes to ``ast.literal_eval``.
_MAX_LITERAL = 1000

# NeMo's two patterns: ``${...}`` and ``$NAME`` (dots allowed inside the name).
_ENV_REFERENCE = re.compile(r"\$\{[^}]+\}|\$[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")


@dataclass(frozen=True)
class Unresolved:
    """A value NeMo resolves from the environment of the run: unknown to the doctor.

    Attributes:
        token: the string as written (``"${oc.env:DTYPE,bf16}"``).
    """

    token: str

    def __str__(self) -> str:
        return self.token


class UnknownValueError(LookupError):
    """A value the doctor needs is `Unresolved`: the facts it feeds are unknown."""


def translate_value(value: Any) -> Any:
    """A scalar as NeMo's loader turns it into a Python value (see the module doc)."""
    if not isinstance(value, str):
        return value
    if _ENV_REFERENCE.search(value):
        return Unresolved(value)
    if value in NEMO_SYMBOLS:
        return NEMO_SYMBOLS[value]
    if len(value) > _MAX_LITERAL:
        return value
    try:
        return ast.literal_eval(value)  # literals only: nothing is executed
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def _translate(node: Any, key: str = "") -> Any:
    if isinstance(node, Mapping):
        return {k: _translate(v, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_translate(v) for v in node]
    if key == "_target_" or key.endswith("_fn"):
        return node  # import paths in NeMo; compared with allowlists here, never imported
    return translate_value(node)


def nemo_view(doc: ConfigDoc) -> ConfigDoc:
    """`doc` with every value translated as NeMo translates it (lines unchanged)."""
    return ConfigDoc(source=doc.source, data=_translate(doc.data), lines=doc.lines)


def unresolved_paths(node: Any, prefix: str = "") -> list[tuple[str, Unresolved]]:
    """Every dotted key path holding an `Unresolved` value, in document order."""
    out: list[tuple[str, Unresolved]] = []
    if isinstance(node, Unresolved):
        out.append((prefix, node))
    elif isinstance(node, Mapping):
        for k, v in node.items():
            out.extend(unresolved_paths(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(unresolved_paths(v, f"{prefix}[{i}]"))
    return out
