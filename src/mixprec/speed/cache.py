"""Measured step times on disk, so `auto` measures a device and shape once.

One small JSON file per measurement under ``speed/`` in mixprec's cache folder
(`mixprec.userdirs.user_cache_dir`: ``$MIXPREC_CACHE_DIR``, else
``$XDG_CACHE_HOME/mixprec``, else the platform's user cache). Its name is a
digest of the key: the device's facts (`DeviceCaps`), the torch version, the
thread count, the target's signature (model structure and input shapes, or the
matmul shapes), the formats and the warm-up/repeat counts. The file holds the key
itself too, and an entry is used only when that key matches exactly.

Writes go to a temporary file in the same folder and are renamed over the entry
(atomic: a reader sees the old file or the new one, never half of one). A file
that cannot be read, is not valid JSON, or does not hold what an entry holds is
ignored (measured again and replaced), never an error; so is a folder that
cannot be written.

The mode comes from the `cache=` argument, else ``$MIXPREC_SPEED_CACHE``:
``use`` (default: read, and store what was measured), ``refresh`` (measure again
and store), ``off`` (measure, neither read nor store).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

from mixprec.speed.decide import CANDIDATE_FORMATS
from mixprec.userdirs import user_cache_dir

__all__ = [
    "CACHE_ENV",
    "CACHE_MODES",
    "SCHEMA",
    "CacheMode",
    "cache_mode",
    "entry_path",
    "key_digest",
    "read_entry",
    "speed_cache_dir",
    "write_entry",
]

#: How the cache is used: read and store, measure again and store, or neither.
CacheMode = Literal["use", "refresh", "off"]
CACHE_MODES: tuple[str, ...] = ("use", "refresh", "off")

#: The environment variable that sets the mode when no argument does.
CACHE_ENV = "MIXPREC_SPEED_CACHE"

#: Version of the entry layout; an entry of another version is ignored.
SCHEMA = 1


def cache_mode(mode: str | None = None) -> CacheMode:
    """The cache mode: `mode` when given, else ``$MIXPREC_SPEED_CACHE``, else ``"use"``.

    Raises:
        ValueError: a mode (argument or variable) other than use, refresh, off.
    """
    source = "cache" if mode is not None else CACHE_ENV
    value = mode if mode is not None else os.environ.get(CACHE_ENV, "").strip() or "use"
    if value not in CACHE_MODES:
        raise ValueError(f"{source}={value!r} is not a cache mode; valid: {', '.join(CACHE_MODES)}")
    return cast(CacheMode, value)


def speed_cache_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The folder entries live in: `root`, else ``speed/`` in mixprec's cache folder."""
    return Path(root) if root is not None else user_cache_dir() / "speed"


def key_digest(key: Mapping[str, Any]) -> str:
    """The digest that names an entry (sha256 of the key's canonical JSON, 24 hex digits)."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def entry_path(key: Mapping[str, Any], root: str | os.PathLike[str] | None = None) -> Path:
    """Where the entry for `key` lives."""
    return speed_cache_dir(root) / f"{key_digest(key)}.json"


def _valid_samples(data: object) -> dict[str, tuple[float, ...]] | None:
    if not isinstance(data, dict) or "fp32" not in data:
        return None
    out: dict[str, tuple[float, ...]] = {}
    for name, values in data.items():
        if name not in CANDIDATE_FORMATS or not isinstance(values, list) or not values:
            return None
        if not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in values
        ):
            return None
        out[name] = tuple(float(v) for v in values)
    return out


def read_entry(
    key: Mapping[str, Any], root: str | os.PathLike[str] | None = None
) -> tuple[Literal["hit", "miss", "corrupt"], dict[str, tuple[float, ...]] | None]:
    """The samples stored for `key`: ``("hit", samples)``; ``("miss", None)`` when there
    is no entry; ``("corrupt", None)`` when the file is unreadable, not JSON, does
    not hold an entry for exactly this key, or its samples are not the key's
    formats with the key's repeats each (it is ignored, never an error)."""
    path = entry_path(key, root)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "miss", None
    except (OSError, UnicodeDecodeError):
        return "corrupt", None
    try:
        data = json.loads(text)
    except ValueError:
        return "corrupt", None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("key") != key:
        return "corrupt", None
    samples = _valid_samples(data.get("samples"))
    if samples is None or not _samples_fit(samples, key):
        return "corrupt", None
    return "hit", samples


def _samples_fit(samples: Mapping[str, tuple[float, ...]], key: Mapping[str, Any]) -> bool:
    """The samples are what the key says was measured: its formats, no more and no
    fewer, with its number of repeats each (an edited file can hold anything)."""
    formats = key.get("formats")
    if formats is not None and sorted(samples) != sorted(formats):
        return False
    repeats = key.get("repeats")
    return repeats is None or all(len(v) == repeats for v in samples.values())


def write_entry(
    key: Mapping[str, Any],
    samples: Mapping[str, tuple[float, ...]],
    root: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Store `samples` for `key` atomically; the path, or None when the folder cannot
    be written (a read-only home, a full disk): the cache is an optimisation."""
    path = entry_path(key, root)
    text = json.dumps(
        {"schema": SCHEMA, "key": dict(key), "samples": {k: list(v) for k, v in samples.items()}},
        indent=1,
        sort_keys=True,
    )
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        return path
    except OSError:
        return None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
