"""The layout of a checkpoint root, its manifest, and finding and verifying a checkpoint.

A checkpoint root (``save(root, ...)``)::

    root/
      step_00000100/        one complete checkpoint (see `mixprec.checkpoint.files`)
      step_00000200/
      latest                the name of the newest complete checkpoint (moved last)
      .tmp-step_<N>-<pid>/  an unfinished save (never read; the next save removes it)
      .trash-step_<N>-<pid>/  a checkpoint being removed (likewise)

Each checkpoint's ``manifest.json`` says what it holds (`CheckpointInfo` summarizes
it) and carries a SHA-256 of every file and of itself: `verify` checks them all,
`resolve` picks the checkpoint a `load` reads (``latest``, ``latest-valid`` or a
step). Writing that layout is `mixprec.checkpoint.saving`; reading a checkpoint into
a model and optimizer is `mixprec.checkpoint.loading`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.checkpoint import files
from mixprec.checkpoint.files import MANIFEST

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWarning",
    "checkpoint_info",
    "class_name",
    "list_checkpoints",
    "manifest_digest",
    "read_manifest",
    "remove_leftovers",
    "resolve",
    "step_dirs",
    "verify",
    "written_at",
]

FORMAT = "mixprec-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_LEFTOVER = re.compile(r"^\.(tmp|trash)-step_\d{8,}-\d+$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found, verified or loaded (one line, with
    the file and what is wrong)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (``resume="latest-valid"``) or converted."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A verified checkpoint's manifest, summarized."""

    path: Path
    """The checkpoint's directory (``root/step_<N>``)."""
    step: int
    """The training step it was saved after."""
    policy: dict[str, Any] | None
    """The policy's fields (``Policy.to_dict()``), None when saved without a `Precision`."""
    optimizer: str | None
    """The optimizer's class (``module.Class``), None when saved without one."""
    components: dict[str, int] = field(default_factory=dict)
    """Bytes of tensor data by component (model.params, optimizer.master, ...)."""
    files: dict[str, int] = field(default_factory=dict)
    """Bytes of each file, by name."""
    mixprec_version: str = ""
    torch_version: str = ""
    created: str = ""
    world_size: int = 1
    """How many ranks saved it (1 for a single process)."""
    strategy: str = "single"
    """``"single"`` (one process), ``"sharded"`` (DTensor shards, e.g. FSDP2, written by
    every rank) or ``"replicated"`` (DDP: the model and optimizer saved once, from rank 0)."""

    @property
    def bytes(self) -> int:
        """Bytes on disk, all files."""
        return sum(self.files.values())


def class_name(obj: object) -> str:
    """How a manifest names an optimizer's class (``mixprec.optim.AdamW``, ``torch.optim.SGD``)."""
    cls = type(obj)
    module = cls.__module__
    if module.startswith("mixprec.optim."):
        module = "mixprec.optim"
    elif module.startswith("torch.optim."):
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """The manifest's own SHA-256 (over everything but that field)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(files.canonical_json(body).encode()).hexdigest()


def checkpoint_info(path: Path, manifest: Mapping[str, Any]) -> CheckpointInfo:
    """The `CheckpointInfo` of the checkpoint at `path` with this manifest."""
    return CheckpointInfo(
        path=path,
        step=int(manifest["step"]),
        policy=manifest.get("policy"),
        optimizer=manifest.get("optimizer"),
        components=dict(manifest.get("components", {})),
        files={k: int(v["bytes"]) for k, v in manifest["files"].items()},
        mixprec_version=str(manifest.get("mixprec_version", "")),
        torch_version=str(manifest.get("torch_version", "")),
        created=str(manifest.get("created", "")),
        world_size=int(manifest.get("world_size", 1)),
        strategy=str(manifest.get("strategy", "single")),
    )


def read_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's manifest, its own checksum and its file list checked (not the files)."""
    where = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not where.is_file():
        raise CheckpointError(f"{where}: missing (the save did not finish)")
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON, truncated or corrupt ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a mixprec checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: checkpoint format version {manifest.get('version')!r}; this mixprec "
            f"reads version {FORMAT_VERSION}"
        )
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise CheckpointError(f"{where}: corrupt (its checksum does not match its contents)")
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        raise CheckpointError(f"{where}: lists no files")
    for name, entry in listed.items():
        if not files.is_plain_name(name) or (path / name).is_symlink():
            raise CheckpointError(f"{where}: lists {name!r}, not a file of this checkpoint")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)):
            raise CheckpointError(f"{where}: the entry of {name!r} is malformed")
    return manifest


def verify(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check one checkpoint directory: its manifest and every file's size and SHA-256.

    Raises:
        CheckpointError: naming the first file that is missing, truncated or altered.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for name, entry in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{f}: {size} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        if files.file_digest(f) != entry["sha256"]:
            raise CheckpointError(f"{f}: corrupt (SHA-256 differs from the manifest's)")
    return checkpoint_info(path, manifest)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints under a root (renamed into place), oldest first, unverified."""
    return [p for _, p in step_dirs(Path(directory))]


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The ``step_<N>`` directories under `root`, as (N, path), by step."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def remove_leftovers(root: Path) -> None:
    """Remove what unfinished saves left under `root` (``.tmp-*``, ``.trash-*``)."""
    for entry in root.iterdir():
        if _LEFTOVER.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _pointed(root: Path) -> Path | None:
    """The checkpoint `latest` names, if it names one."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _STEP_DIR.match(name) and (root / name).is_dir() else None


def written_at(path: Path) -> int:
    """When a checkpoint was saved (ns; its manifest's, else the directory's mtime)."""
    try:
        return int(json.loads((path / MANIFEST).read_text(encoding="utf-8"))["saved_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return path.stat().st_mtime_ns
        except OSError:
            return 0


def _latest(root: Path) -> Path:
    pointer = root / LATEST
    if not pointer.is_file():
        if (root / MANIFEST).is_file():
            return root  # a checkpoint directory itself
        raise CheckpointError(f"{root}: no checkpoint here (no '{LATEST}' file)")
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = "<unreadable>"
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: names {name[:60]!r}, not a checkpoint (corrupt?)")
    return root / name


def resolve(directory: str | os.PathLike[str], resume: str | int = "latest") -> CheckpointInfo:
    """The checkpoint `load` would read, verified (see `load` for `resume`).

    Raises:
        CheckpointError: none found, or the one asked for does not verify.
    """
    root = Path(directory)
    if isinstance(resume, bool):
        raise CheckpointError(f"resume must be 'latest', 'latest-valid' or a step, got {resume!r}")
    if isinstance(resume, int):
        if resume < 0:
            raise CheckpointError(f"resume step must be >= 0, got {resume}")
        info = verify(root / f"step_{resume:08d}")
        if info.step != resume:
            raise CheckpointError(f"{info.path}: its manifest says step {info.step}")
        return info
    if resume == "latest":
        try:
            return verify(_latest(root))
        except CheckpointError as exc:
            raise CheckpointError(
                f"{exc}; resume='latest-valid' falls back to an older one"
            ) from None
    if resume == "latest-valid":
        if (root / MANIFEST).is_file():
            return verify(root)
        # `latest` first; then older steps of its line, most recently written first.
        # Higher steps than `latest`'s were abandoned by a rollback (or never finished
        # their save): they are not taken.
        pointed = _pointed(root)
        below = int(pointed.name.split("_")[1]) if pointed is not None else None
        others = sorted(
            (p for s, p in step_dirs(root) if p != pointed and (below is None or s < below)),
            key=written_at,
            reverse=True,
        )
        problems = []
        for candidate in [p for p in (pointed,) if p is not None] + others:
            try:
                info = verify(candidate)
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            for problem in problems:
                warnings.warn(f"skipped a checkpoint: {problem}", CheckpointWarning, stacklevel=3)
            return info
        detail = f" ({len(problems)} found, none verifies: {problems[0]})" if problems else ""
        raise CheckpointError(f"{root}: no valid checkpoint{detail}")
    raise CheckpointError(
        f"resume must be 'latest', 'latest-valid' or a step number, got {resume!r}"
    )
