"""Reading training configs for the doctor: YAML loading, key locations, format detection.

Nothing in a config is imported or executed: files are read with
`yaml.safe_load`, and ``_target_`` strings are only compared against allowlists
of known names. Unknown keys are ignored (except inside mixprec's ``precision:``
mapping, which `mixprec.Policy.from_dict` validates strictly, as a run would).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
import yaml

from mixprec.device import DeviceCaps, device_caps
from mixprec.doctor.facts import TrainingFacts
from mixprec.doctor.findings import Finding, sort_findings
from mixprec.doctor.rules import run_static_rules
from mixprec.safe_yaml import read_yaml_file

__all__ = [
    "FORMATS",
    "NEMO_MARKERS",
    "ConfigDoc",
    "ConfigFormat",
    "DeviceArg",
    "check_config",
    "check_file",
    "detect_format",
    "load_config",
    "read_config",
    "resolve_device",
]

ConfigFormat = Literal["mixprec", "nemo"]
DeviceArg = DeviceCaps | torch.device | str | None

#: The accepted values of ``--format``.
FORMATS: tuple[str, ...] = ("auto", "mixprec", "nemo")

#: Top-level keys that mark a NeMo AutoModel recipe.
NEMO_MARKERS: frozenset[str] = frozenset(
    {
        "step_scheduler",
        "dist_env",
        "recipe",
        "peft",
        "loss_fn",
        "distributed_config",
        "packed_sequence",
        "validation_dataset",
        "dataloader",
        "autopipeline",
        "parallelizer",
    }
)


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


def _read(path: str | os.PathLike[str]) -> ConfigDoc:
    p = Path(path)
    doc = read_yaml_file(p)  # safe and bounded; ValueError/FileNotFoundError name the file
    if not isinstance(doc.data, Mapping):
        raise ValueError(
            f"{p}: a training config must be a YAML mapping, got {type(doc.data).__name__}"
        )
    return ConfigDoc(
        source=str(p), data=cast(Mapping[str, Any], doc.data), lines=_line_map(doc.root)
    )


def _has_target(node: Any) -> bool:
    if isinstance(node, Mapping):
        return "_target_" in node or any(_has_target(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_target(v) for v in node)
    return False


def detect_format(data: Mapping[str, Any], *, source: str = "config") -> ConfigFormat:
    """``"mixprec"`` for a top-level ``precision:`` mapping, ``"nemo"`` for NeMo AutoModel
    recipes (``step_scheduler``, ``model._target_``, ``_target_`` keys...).

    Raises:
        ValueError: when the content matches neither (pass the format explicitly).
    """
    if isinstance(data.get("precision"), Mapping):
        return "mixprec"
    model = data.get("model")
    if NEMO_MARKERS & set(data) or (
        isinstance(model, Mapping) and ("_target_" in model or "torch_dtype" in model)
    ):
        return "nemo"
    if _has_target(data):
        return "nemo"
    keys = ", ".join(sorted(str(k) for k in data)[:8]) or "none"
    raise ValueError(
        f"{source}: cannot tell the config format (top-level keys: {keys}); a mixprec config "
        "has a top-level 'precision:' mapping, a NeMo AutoModel recipe has 'model:', "
        "'optimizer:', 'step_scheduler:'...; pass --format mixprec or --format nemo"
    )


def resolve_device(device: DeviceArg) -> DeviceCaps | None:
    """`DeviceCaps` for a device argument (None stays None)."""
    if device is None or isinstance(device, DeviceCaps):
        return device
    return device_caps(device)


def check_config(
    doc: ConfigDoc, *, format: str = "auto", device: DeviceArg = None
) -> tuple[ConfigFormat, TrainingFacts, list[Finding]]:
    """Judge a parsed config: its format, its facts, and the findings (sorted).

    Raises:
        ValueError: for an unknown `format`, an undetectable format, or invalid values.
    """
    from mixprec.doctor.mixprec_yaml import facts_from_mixprec
    from mixprec.doctor.nemo_yaml import facts_from_nemo

    if format not in FORMATS:
        raise ValueError(f"unknown config format {format!r}; valid: {', '.join(FORMATS)}")
    fmt: ConfigFormat = (
        detect_format(doc.data, source=doc.source)
        if format == "auto"
        else cast(ConfigFormat, format)
    )
    caps = resolve_device(device)
    facts = (
        facts_from_mixprec(doc, device=caps)
        if fmt == "mixprec"
        else facts_from_nemo(doc, device=caps)
    )
    return fmt, facts, sort_findings(run_static_rules(facts))


def load_config(
    path: str | os.PathLike[str], *, format: str = "auto", device: DeviceArg = None
) -> TrainingFacts:
    """The `TrainingFacts` of a config file (mixprec YAML or NeMo AutoModel YAML).

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: for invalid YAML, an unknown format, or invalid values.
    """
    return check_config(_read(path), format=format, device=device)[1]


def check_file(
    path: str | os.PathLike[str], *, format: str = "auto", device: DeviceArg = None
) -> list[Finding]:
    """Lint one config file: the findings of every static rule, errors first.

    Args:
        path: a mixprec YAML config or a NeMo AutoModel recipe.
        format: ``"auto"`` (detect from content), ``"mixprec"`` or ``"nemo"``.
        device: the device the run targets (a `DeviceCaps`, a device or its name);
            overrides a mixprec config's ``device:``. Without one,
            ``format-not-accelerated`` is not judged for NeMo recipes.

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: for invalid YAML, an unknown format, or invalid values, with a
            one-line reason.
    """
    return check_config(_read(path), format=format, device=device)[2]


def read_config(path: str | os.PathLike[str]) -> ConfigDoc:
    """Parse a config file (safe YAML, with key lines); raises like `check_file`."""
    return _read(path)
