"""The files of a checkpoint: tensors through DCP, everything else as JSON.

A checkpoint is a directory ``step_<N>`` holding what `torch.distributed.checkpoint`
writes (a ``.metadata`` file and the ``*.distcp`` data files) and a
``manifest.json`` written last: the step, the policy, the non-tensor state as
JSON, the bytes by component and a SHA-256 per file (the manifest carries its own
checksum too). Nothing in a checkpoint executes code on load:

* tensors are read by DCP, which loads each with ``torch.load(weights_only=True)``;
* DCP's ``.metadata`` is a pickle: `SafeReader` unpickles it with an allowlist of
  DCP's own metadata classes, torch dtypes and sizes, and refuses anything else;
* everything that is not a tensor (hyperparameters, scaler, telemetry, Python and
  NumPy RNG states, the user's ``extra``) is JSON in the manifest, never pickled.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import secrets
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

__all__ = [
    "MANIFEST",
    "SafeReader",
    "TreeError",
    "atomic_path",
    "atomic_write_text",
    "file_digest",
    "fsync_dir",
    "is_plain_name",
    "join_tree",
    "read_dcp",
    "read_tensor_metadata",
    "split_tree",
    "write_dcp",
]

MANIFEST = "manifest.json"

#: Globals DCP's metadata pickle may name (module -> names; None: any name there).
_METADATA_GLOBALS: Mapping[str, frozenset[str] | None] = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class TreeError(ValueError):
    """A value a checkpoint cannot store without pickling."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _METADATA_GLOBALS.get(module, frozenset())
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or allowed is None or name in allowed:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's file reader, unpickling ``.metadata`` with an allowlist (see module docs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise ValueError(f"{path}: not DCP metadata ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


@contextmanager
def _single_process() -> Iterator[None]:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def write_dcp(
    tensors: dict[str, torch.Tensor], directory: Path, *, collective: bool = False
) -> None:
    """Write `tensors` with DCP into `directory` (files flushed to disk).

    With `collective`, every rank of the default process group calls this with its
    own part (DTensor shards, rank-local keys) and DCP writes one checkpoint.
    """
    if collective:
        dcp_save(tensors, storage_writer=FileSystemWriter(directory, sync_files=True))
        return
    with _single_process():
        dcp_save(
            tensors,
            storage_writer=FileSystemWriter(directory, sync_files=True),
            no_dist=True,
        )


def read_tensor_metadata(
    directory: Path, verified: frozenset[str]
) -> dict[str, TensorStorageMetadata]:
    """Each saved tensor's size and dtype, by key (read with `SafeReader`); the data
    files it names must be among the `verified` ones."""
    metadata = SafeReader(directory).read_metadata()
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not is_plain_name(name) or name not in verified:
            raise ValueError(f"{directory / '.metadata'}: names a data file {name!r} it may not")
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"{directory}: entry {key!r} is not a tensor")
        out[key] = entry
    return out


def read_dcp(
    directory: Path,
    keys: list[str],
    verified: frozenset[str],
    *,
    make: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    collective: bool = False,
) -> dict[str, torch.Tensor]:
    """Read the tensors named `keys` into new CPU tensors, from `verified` files only.

    Args:
        make: ``make(key, size, dtype)`` gives the empty tensor to read a key into
            (a DTensor reads only its shard); default: a plain tensor of the whole size.
        collective: every rank of the default process group calls this (its own keys).
    """
    metadata = read_tensor_metadata(directory, verified)
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise ValueError(f"{directory}: the tensor data lacks {missing[:3]}")
    out = {}
    for k in keys:
        size, dtype = tuple(metadata[k].size), metadata[k].properties.dtype
        out[k] = torch.empty(size, dtype=dtype) if make is None else make(k, size, dtype)
    if collective:
        dcp_load(out, storage_reader=SafeReader(directory))
    elif out:
        with _single_process():
            dcp_load(out, storage_reader=SafeReader(directory), no_dist=True)
    return out


# ------------------------------------------------------------------ JSON + tensors


def split_tree(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON data, its tensors moved into `tensors` under `path`-based keys.

    Dicts with string keys stay dicts; other dicts (an optimizer's integer ids),
    tuples and tensors become tagged objects that `join_tree` turns back.

    Raises:
        TreeError: a value that is not a tensor, number, string, bool, None, list,
            tuple or dict (it could only be stored by pickling).
    """
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.device.type == "meta":
            raise TreeError(
                f"{path}: a {value.layout} tensor on {value.device} holds no dense data"
            )
        key, n = path, 1
        while key in tensors:  # "a/b" as one key and as a nested one: keep both
            key, n = f"{path}#{n}", n + 1
        tensors[key] = value.detach()
        return {"__tensor__": key}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [split_tree(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [split_tree(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        plain = all(isinstance(k, str) and not k.startswith("__") for k in value)
        if plain:
            return {k: split_tree(v, f"{path}/{k}", tensors) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, int | str):
                raise TreeError(f"{path}: a dict key {k!r} is neither a string nor an int")
            items.append([k, split_tree(v, f"{path}/{k}", tensors)])
        return {"__items__": items}
    raise TreeError(
        f"{path}: a {type(value).__name__} cannot be stored without pickling; use tensors, "
        "numbers, strings, lists and dicts"
    )


def join_tree(data: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Invert `split_tree`."""
    if isinstance(data, list):
        return [join_tree(v, tensors) for v in data]
    if isinstance(data, dict):
        if set(data) == {"__tensor__"}:
            return tensors[data["__tensor__"]]
        if set(data) == {"__tuple__"}:
            return tuple(join_tree(v, tensors) for v in data["__tuple__"])
        if set(data) == {"__items__"}:
            return {k: join_tree(v, tensors) for k, v in data["__items__"]}
        return {k: join_tree(v, tensors) for k, v in data.items()}
    return data


def tensor_keys(data: Any) -> list[str]:
    """The tensor keys a `split_tree` result refers to."""
    if isinstance(data, list):
        return [k for v in data for k in tensor_keys(v)]
    if isinstance(data, dict):
        if set(data) == {"__tensor__"}:
            return [data["__tensor__"]]
        return [k for v in data.values() for k in tensor_keys(v)]
    return []


# ------------------------------------------------------------------------- disk


def is_plain_name(name: str) -> bool:
    """Whether `name` is a file name inside its directory (no separator, not ``..``)."""
    return bool(name) and name not in (".", "..") and "/" not in name and os.sep not in name


def file_digest(path: Path) -> str:
    """SHA-256 of a file, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk where the OS allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A fresh temporary path beside `path` to write; renamed over `path` on success.

    When the block returns, the file is given the mode any new file gets here
    (0o666 less the umask, as the empty file created first got it; writers such
    as safetensors' ``save_file`` and ``tempfile.mkstemp`` leave 0o600), flushed
    to disk and renamed over `path`, and the directory is flushed: `path` holds
    the old file or the complete new one, never part of one. When the block
    raises, the temporary file is removed.
    """
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        mode = stat.S_IMODE(tmp.stat().st_mode)
        yield tmp
        os.chmod(tmp, mode)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def canonical_json(data: Any) -> str:
    """The JSON text a checksum is taken over (sorted keys, no spaces)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
