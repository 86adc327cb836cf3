"""A parsed config file with the line of every key: what every config front end reads.

Nothing in a config is imported or executed: files are read with
`yaml.safe_load` (through `mixprec.safe_yaml`), and line numbers come from
composing the YAML into nodes, never from constructing objects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from mixprec.safe_yaml import read_yaml_file

__all__ = ["ConfigDoc", "NotAMappingError", "read_config"]


class NotAMappingError(ValueError):
    """A file that is valid YAML but whose top level is not a mapping (no config)."""


@dataclass(frozen=True, kw_only=True)
class ConfigDoc:
    """A parsed config with the line of every key path.

    Attributes:
        source: the file path (or a label for in-memory data).
        data: the top-level mapping.
        lines: dotted key path (``"optimizer._target_"``) to its 1-based line.
    """

    source: str
    data: Mapping[str, Any]
    lines: Mapping[str, int] = field(default_factory=dict)

    def get(self, path: str, default: Any = None) -> Any:
        """The value at a dotted key path, or `default` when any part is missing."""
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    def has(self, path: str) -> bool:
        """Whether the dotted key path exists."""
        sentinel = object()
        return self.get(path, sentinel) is not sentinel

    def loc(self, *paths: str) -> str:
        """``"file:line key.path"`` for the first of `paths` that exists (else the file)."""
        for path in paths:
            if self.has(path):
                line = self.lines.get(path)
                return f"{self.source}:{line} {path}" if line else f"{self.source} {path}"
        return self.source

    def mapping(self, path: str) -> Mapping[str, Any] | None:
        """The mapping at `path`; None when absent or null; ValueError when not a mapping."""
        value = self.get(path)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{self.loc(path)}: expected a mapping, got {type(value).__name__} {value!r}"
            )
        return cast(Mapping[str, Any], value)


def _line_map(root: yaml.Node | None) -> dict[str, int]:
    """Dotted key path to the 1-based line of its key (from the composed nodes)."""
    out: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                path = f"{prefix}.{name}" if prefix else name
                out.setdefault(path, key.start_mark.line + 1)
                walk(value, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{prefix}[{i}]")

    if root is not None:
        walk(root, "")
    return out


def read_config(path: str | os.PathLike[str]) -> ConfigDoc:
    """Parse a config file (safe YAML, with key lines).

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: for invalid YAML, naming the file; `NotAMappingError` (a
            ValueError) for a top level that is not a mapping.
    """
    p = Path(path)
    doc = read_yaml_file(p)  # safe and bounded; ValueError/FileNotFoundError name the file
    if not isinstance(doc.data, Mapping):
        raise NotAMappingError(
            f"{p}: a training config must be a YAML mapping, got {type(doc.data).__name__}"
        )
    return ConfigDoc(
        source=str(p), data=cast(Mapping[str, Any], doc.data), lines=_line_map(doc.root)
    )
