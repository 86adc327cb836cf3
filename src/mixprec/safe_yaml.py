"""The one YAML reader of mixprec: safe, bounded, and with line numbers.

Every file mixprec reads as YAML or JSON (doctor configs, compare contracts,
model configs for `budget`) goes through `load_yaml`:

* ``yaml.SafeLoader`` only (libyaml's ``CSafeLoader`` where PyYAML was built with
  it, about 10x faster, else the pure-Python one): no Python tags, nothing is
  executed;
* bounded: at most `MAX_BYTES` of text, nesting at most `MAX_DEPTH` deep and at
  most `MAX_EXPANDED_NODES` nodes as written (both checked on the event stream,
  before PyYAML's recursive composer could hit Python's recursion limit or spend
  seconds on a huge file), and at most `MAX_EXPANDED_NODES` nodes once every alias is
  expanded (a few hundred bytes of nested aliases, the "billion laughs", would
  otherwise expand to billions of nodes in whatever walks the result);
  recursive aliases and keys repeated within one mapping are refused;
* every failure is a `ValueError` naming the file and, where known, the line.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_EXPANDED_NODES",
    "YamlDocument",
    "load_yaml",
    "read_config_text",
    "read_yaml_file",
]

#: Largest document read, in bytes.
MAX_BYTES = 16 * 2**20
#: Deepest nesting of mappings and sequences.
MAX_DEPTH = 64
#: Most nodes of the document with every alias expanded.
MAX_EXPANDED_NODES = 200_000

#: The safe loader: libyaml's when PyYAML has it (same tags and resolution, in C).
_SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class YamlDocument:
    """A parsed document.

    Attributes:
        data: the Python value (dicts, lists, str, int, float, bool, None...).
        root: the composed node graph (with marks for line numbers), or None for an
            empty document.
    """

    data: Any
    root: yaml.Node | None


def _where(source: str, mark: Any) -> str:
    if mark is None:
        return source
    return f"{source}:{mark.line + 1}"


def _check_depth(text: str, source: str) -> None:
    """Bound the nesting and the nodes as written, on the event stream (before composing
    the nodes, which is what takes the time for a large document)."""
    depth = 0
    nodes = 0
    too_deep = (
        f"nested more than {MAX_DEPTH} levels deep; a training config never is: check the file"
    )
    try:
        for event in yaml.parse(text, Loader=_SafeLoader):
            if isinstance(event, yaml.ScalarEvent | yaml.CollectionStartEvent):
                nodes += 1
                if nodes > MAX_EXPANDED_NODES:
                    raise ValueError(
                        f"{_where(source, event.start_mark)}: holds more than "
                        f"{MAX_EXPANDED_NODES:,} YAML nodes (keys, values and list items), the "
                        "most a config may hold (mixprec.safe_yaml.MAX_EXPANDED_NODES); a "
                        "training config is never this large"
                    )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise ValueError(f"{_where(source, event.start_mark)}: {too_deep}")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as exc:
        # libyaml's scanner (PyYAML >= 6.0.4 with the C loader) stops deep flow nesting
        # itself, before the events reach this count: the same refusal, in the same words.
        if "nesting depth" not in str(exc):
            raise
        raise ValueError(
            f"{_where(source, getattr(exc, 'problem_mark', None))}: {too_deep}"
        ) from None


def _check_duplicate_keys(node: yaml.Node, source: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key, _value in node.value:
        if isinstance(key, yaml.ScalarNode):
            if key.value in seen:
                raise ValueError(
                    f"{_where(source, key.start_mark)}: key {key.value!r} appears twice in one "
                    "mapping (YAML would keep the last silently); keep one"
                )
            seen.add(key.value)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Count nodes with aliases expanded (shared nodes counted once per reference)."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            in_progress.discard(key)
            total = 1 + sum(sizes[id(c)] for c in _children(node))
            if total > MAX_EXPANDED_NODES:
                raise ValueError(
                    f"{_where(source, node.start_mark)}: expands through aliases to more "
                    f"than {MAX_EXPANDED_NODES:,} YAML nodes, the most a config may hold "
                    "(mixprec.safe_yaml.MAX_EXPANDED_NODES; an alias bomb?); write the "
                    "values out or use fewer nested aliases"
                )
            sizes[key] = total
            continue
        if key in sizes:
            continue
        _check_duplicate_keys(node, source)
        if key in in_progress:
            raise ValueError(
                f"{_where(source, node.start_mark)}: a recursive alias (a value that "
                "contains itself); configs must be finite trees"
            )
        in_progress.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in in_progress:
                raise ValueError(
                    f"{_where(source, child.start_mark)}: a recursive alias (a value that "
                    "contains itself); configs must be finite trees"
                )
            if id(child) not in sizes:
                stack.append((child, False))


def load_yaml(text: str, *, source: str = "<string>") -> YamlDocument:
    """Parse one YAML (or JSON) document safely, within the bounds above.

    Raises:
        ValueError: invalid YAML, more than one document, or a bound exceeded,
            naming `source` and the line.
    """
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_BYTES:
        raise ValueError(f"{source}: larger than {MAX_BYTES // 2**20} MiB; not a config file")
    try:
        _check_depth(text, source)
        loader = _SafeLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                return YamlDocument(data=None, root=None)
            _check_expansion(root, source)
            data = loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{_where(source, mark)}: not valid YAML: {problem}") from None
    except RecursionError:  # pragma: no cover - the depth bound comes first
        raise ValueError(f"{source}: nested too deeply to read") from None
    return YamlDocument(data=data, root=root)


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of a config file: a regular file of at most `MAX_BYTES`, UTF-8.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file, too large, not UTF-8, or unreadable.
    """
    p = Path(path)
    if not p.is_file():
        if p.exists():
            raise ValueError(f"{p}: not a regular file")
        if p.is_symlink():
            raise FileNotFoundError(_dangling(p))
        raise FileNotFoundError(f"{p}: no such file; check the path")
    try:
        if p.stat().st_size > MAX_BYTES:
            raise ValueError(f"{p}: larger than {MAX_BYTES // 2**20} MiB; not a config file")
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{p}: cannot read: {exc.strerror or exc}") from None


def _dangling(link: Path) -> str:
    """Why a symbolic link leads to no file: a loop, or a target that does not exist
    (at the end of a chain of links, the path that is missing)."""
    target = os.readlink(link)
    try:
        os.stat(link)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (
                f"{link}: a symbolic link loop (following {target!r} never reaches a file); "
                "point the link at a file"
            )
    to = repr(target)
    if (link.parent / target).is_symlink():  # a chain: name the end that is missing
        to += f", a link to {os.path.realpath(link)!r}"
    return f"{link}: a broken symbolic link (to {to}, which does not exist)"


def read_yaml_file(path: str | os.PathLike[str]) -> YamlDocument:
    """Read and parse a YAML or JSON file (see `load_yaml`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not readable UTF-8 text, or `load_yaml` refuses it.
    """
    p = Path(path)
    text = read_config_text(p)
    if p.suffix.lower() == ".json":
        # JSON allows tabs as whitespace and forbids them raw inside strings, so every
        # tab is insignificant; YAML refuses tabs that indent (DeepSpeed's JSON has them).
        text = text.replace("\t", " ")
    return load_yaml(text, source=str(p))
