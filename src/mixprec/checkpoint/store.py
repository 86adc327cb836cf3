"""`save` and `load`: the whole training state, exactly, atomically, verified.

Layout of a checkpoint root (``save(root, ...)``)::

    root/
      step_00000100/        one complete checkpoint (see `mixprec.checkpoint.files`)
      step_00000200/
      latest                the name of the newest complete checkpoint (moved last)

A save writes ``root/.tmp-step_<N>-<pid>/`` (DCP's files, flushed, then
``manifest.json`` with a checksum per file), renames it to ``step_<N>``, then
replaces ``latest`` through a flushed temporary file, then removes checkpoints
beyond ``keep_last``. A crash at any point leaves the previous ``latest``
pointing at a complete checkpoint; leftovers of an unfinished save (``.tmp-*``,
``.trash-*``) are never read and are removed by the next save.

What is saved: the model's state dict (storage dtypes), the optimizer's state
dict keyed by parameter name (mixprec's masters and moments in their own
representation: remainders, Kahan buffers, int8 codes and scales, step counters
and rounding seeds), `Precision`'s scaler and telemetry, the RNG states of torch
(CPU and CUDA), Python and NumPy, the step, the policy, and the caller's
``extra`` (tensors, numbers, strings, lists and dicts: e.g. the data position or
a scheduler's state dict).

With a process group (FSDP2, DDP), `save` and `load` are collective: every rank
calls them (see `mixprec.checkpoint.ranks`). DCP writes each rank's DTensor shards
and rank 0's plain tensors (replicated state, saved once) into one temporary
directory; rank 0 alone writes the manifest, renames and moves ``latest`` after
every rank's data is written. Each rank's RNG states are saved under their own
keys. A load reads every DTensor as a DTensor sharded like the live one, so DCP
reshards across world sizes (a process group of 2 to one process and back).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from mixprec.checkpoint import files, ranks
from mixprec.checkpoint.files import MANIFEST, TreeError, join_tree, split_tree, tensor_keys
from mixprec.formats import master_state_keys, moment_state_keys
from mixprec.optim.sharding import is_dtensor
from mixprec.policy import Policy
from mixprec.version import __version__

if TYPE_CHECKING:
    from mixprec.engine import Precision

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWarning",
    "list_checkpoints",
    "load",
    "resolve",
    "save",
    "verify",
]

FORMAT = "mixprec-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_LEFTOVER = re.compile(r"^\.(tmp|trash)-step_\d{8,}-\d+$")

#: Policy fields that do not change what a checkpoint holds.
_DESCRIPTIVE_FIELDS = ("name", "note")


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


# ------------------------------------------------------------------------ save


def _reached(phase: str) -> None:
    """Called as a save passes each of its steps (a seam for fault-injection tests)."""


def _param_names(model: nn.Module | None) -> dict[torch.Tensor, str]:
    if model is None:
        return {}
    names: dict[torch.Tensor, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
    return names


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _param_keys(optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> list[str]:
    """The key each optimizer parameter is saved under: its name in the model."""
    keys = []
    for i, p in enumerate(_optimizer_params(optimizer)):
        name = names.get(p)
        if name is None:
            raise CheckpointError(
                f"optimizer parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                "model: pass the model the optimizer trains"
            )
        keys.append(name)
    if len(set(keys)) != len(keys):
        raise CheckpointError("the optimizer holds one parameter twice: its state is ambiguous")
    return keys


def _named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """The optimizer's state dict with parameter names for its integer ids."""
    keys = _param_keys(optimizer, names)
    sd = optimizer.state_dict()
    ids = [pid for group in sd["param_groups"] for pid in group["params"]]
    key_of = dict(zip(ids, keys, strict=True))
    return {
        "state": {key_of[pid]: value for pid, value in sd["state"].items()},
        "param_groups": [
            {**g, "params": [key_of[pid] for pid in g["params"]]} for g in sd["param_groups"]
        ],
    }


def _indexed_optimizer_state(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """`_named_optimizer_state` output as `optimizer.load_state_dict` takes it."""
    keys = _param_keys(optimizer, names)
    index = {key: i for i, key in enumerate(keys)}
    groups = saved.get("param_groups")
    state = saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise CheckpointError("the saved optimizer state is malformed")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} param groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer as the run did"
        )
    out_groups = []
    for i, (group, mine) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        saved_keys = list(group.get("params", []))
        my_keys = [keys[index[names[p]]] for p in mine["params"]]
        if saved_keys != my_keys:
            missing = sorted(set(my_keys) - set(saved_keys))[:3]
            extra = sorted(set(saved_keys) - set(my_keys))[:3]
            raise CheckpointError(
                f"param group {i} of the checkpoint holds other parameters (missing here: "
                f"{extra}, not saved: {missing}): build the optimizer as the run did"
            )
        out_groups.append({**group, "params": [index[k] for k in saved_keys]})
    unknown = sorted(set(state) - set(index))[:3]
    if unknown:
        raise CheckpointError(
            f"the checkpoint holds optimizer state for unknown parameters {unknown}"
        )
    return {"state": {index[k]: v for k, v in state.items()}, "param_groups": out_groups}


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _component(key: str, param_keys: frozenset[str]) -> str:
    parts = key.split("/")
    if parts[0] == "model":
        return "model.params" if "/".join(parts[1:]) in param_keys else "model.buffers"
    if parts[0] == "optimizer" and len(parts) >= 4 and parts[1] == "state":
        name = parts[-1]
        if name in master_state_keys():
            return "optimizer.master"
        if name in moment_state_keys() or name.startswith("exp_avg"):
            return "optimizer.moments"
        return "optimizer.counters"
    return {"optimizer": "optimizer.other", "rng": "rng"}.get(parts[0], "other")


def _remove_leftovers(root: Path) -> None:
    for entry in root.iterdir():
        if _LEFTOVER.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a whole number >= 0, got {step!r}")
    return step


def save(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    step: int,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> CheckpointInfo:
    """Save the whole training state as ``directory/step_<step>`` and point ``latest`` at it.

    With a process group, every rank calls `save` with its part of the model (an
    FSDP2 model's shards, or a `DistributedDataParallel` model: saved once, from
    rank 0) and the same arguments otherwise; it returns on each rank once the
    checkpoint is complete, or raises the same `CheckpointError` on every rank.

    Args:
        directory: the checkpoint root (created; shared by all ranks).
        model: the model (its state dict, in its storage dtypes).
        optimizer: its optimizer (any `torch.optim.Optimizer`; mixprec's AdamW keeps
            masters and moments in their own representation), or None.
        precision: the run's `Precision` (policy, scaler, telemetry), or None.
        step: the number of optimizer steps taken.
        extra: the caller's state: tensors, numbers, strings, lists and dicts (the
            data position, a scheduler's ``state_dict()``); returned by `load`.
            With several ranks, rank 0's is saved.
        keep_last: keep only this many newest checkpoints (None: keep all).

    Returns:
        The new checkpoint's `CheckpointInfo`.

    Raises:
        CheckpointError: a bad argument, or state that cannot be stored without
            pickling (nothing is written then).
    """
    model = ranks.unwrap(model)
    root = Path(directory)
    state = _together(lambda: _collect(root, model, optimizer, precision, step, extra, keep_last))
    step, tree, tensors, own = state
    _check_same_structure(step, tree)
    me, world = ranks.rank(), ranks.world_size()
    rng_trees = ranks.gather(tree.pop("rng_mine"))
    tree["rng"] = rng_trees[0]
    if world > 1:
        tree["rng_ranks"] = {str(r): t for r, t in enumerate(rng_trees) if r > 0}
    strategy = (
        ("sharded" if any(is_dtensor(t) for t in tensors.values()) else "replicated")
        if world > 1
        else "single"
    )

    name = f"step_{step:08d}"
    tmp = Path(ranks.broadcast(_together(lambda: _make_tmp(root, name) if me == 0 else "")))
    error = None
    try:
        files.write_dcp(ranks.owned(tensors, own), tmp, collective=ranks.is_collective())
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        error = f"writing {tmp} failed, nothing was kept: {first}"
    error = ranks.agree(error)
    if error is not None:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(error)
    if me == 0:
        try:
            _reached("data-written")
            manifest = _commit(
                root,
                tmp,
                name,
                step=step,
                tree=tree,
                tensors=tensors,
                model=model,
                optimizer=optimizer,
                precision=precision,
                keep_last=keep_last,
                world=world,
                strategy=strategy,
            )
            outcome: tuple[str | None, Any] = (None, manifest)
        except Exception as exc:
            if not ranks.is_collective():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = (f"committing {root / name} failed: {exc}", None)
    else:
        outcome = (None, None)
    error, manifest = ranks.broadcast(outcome)
    if error is not None:
        raise CheckpointError(error)
    return _info(root / name, manifest)


def _collect(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    step: int,
    extra: Mapping[str, Any] | None,
    keep_last: int | None,
) -> tuple[int, dict[str, Any], dict[str, torch.Tensor], frozenset[str]]:
    """Checked arguments, the JSON tree, its tensors and this rank's own (RNG) keys."""
    step = _check_step(step)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise CheckpointError(f"keep_last must be a whole number >= 1 or None, got {keep_last!r}")
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root} is a file; checkpoints need a directory")
    names = _param_names(model)
    me = ranks.rank()
    tensors: dict[str, torch.Tensor] = {}
    try:
        tree = {
            "model": split_tree(dict(model.state_dict()), "model", tensors),
            "optimizer": None
            if optimizer is None
            else split_tree(_named_optimizer_state(optimizer, names), "optimizer", tensors),
            "precision": None
            if precision is None
            else split_tree(precision.state_dict(), "precision", tensors),
            "extra": split_tree(dict(extra or {}), "extra", tensors),
        }
        before = set(tensors)
        # Each rank's RNG states under a key of its own; rank 0's where one process
        # keeps them (a single-process load restores those).
        tree["rng_mine"] = split_tree(
            _rng_state(), "rng" if me == 0 else f"rng_ranks/{me}", tensors
        )
    except TreeError as exc:
        raise CheckpointError(f"cannot save {exc}") from None
    return step, tree, tensors, frozenset(set(tensors) - before)


def _check_same_structure(step: int, tree: Mapping[str, Any]) -> None:
    """Refuse, on every rank, a save whose ranks disagree on the step or the keys of
    the model and optimizer (they would write one inconsistent checkpoint)."""
    if not ranks.is_collective():
        return
    shape = files.canonical_json([step, tree["model"], tree["optimizer"]])
    digests = ranks.gather(hashlib.sha256(shape.encode()).hexdigest())
    for r, digest in enumerate(digests):
        if digest != digests[0]:
            raise CheckpointError(
                f"rank {r} saves another step or other model/optimizer keys than rank 0: "
                "every rank must call save with the same step and the same model"
            )


def _make_tmp(root: Path, name: str) -> str:
    """Rank 0: the root created, leftovers removed, a fresh temporary directory made."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {root}: {exc.strerror or exc}") from None
    _remove_leftovers(root)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    return str(tmp)


def _commit(
    root: Path,
    tmp: Path,
    name: str,
    *,
    step: int,
    tree: dict[str, Any],
    tensors: Mapping[str, torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    keep_last: int | None,
    world: int,
    strategy: str,
) -> dict[str, Any]:
    """Rank 0, after every rank's data is written: manifest, rename, ``latest``, prune."""
    param_keys = frozenset(dict(model.named_parameters()))
    components: dict[str, int] = {}
    for key, t in tensors.items():
        kind = _component(key, param_keys)
        components[kind] = components.get(kind, 0) + t.numel() * t.element_size()
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "saved_ns": time.time_ns(),
        "mixprec_version": __version__,
        "torch_version": torch.__version__,
        "world_size": world,
        "strategy": strategy,
        "policy": None if precision is None else precision.policy.to_dict(),
        "optimizer": None if optimizer is None else _class_name(optimizer),
        "components": components,
        "files": {
            f.name: {"bytes": f.stat().st_size, "sha256": files.file_digest(f)}
            for f in sorted(tmp.iterdir())
        },
        "tree": tree,
    }
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    files.atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, allow_nan=True))
    _reached("manifest-written")
    final = root / name
    if final.exists():  # the same step saved again: the new one replaces it
        trash = root / f".trash-{name}-{os.getpid()}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    files.fsync_dir(root)
    _reached("renamed")
    files.atomic_write_text(root / LATEST, name + "\n")
    _reached("latest-moved")
    if keep_last is not None:
        # The run's own line: steps up to this one. Higher steps were abandoned by a
        # rollback (a resume from an older checkpoint): `latest` can never name them.
        line = sorted(
            (p for s, p in _step_dirs(root) if s <= step and p != final),
            key=_written_at,
            reverse=True,
        )
        keep = {final, *line[: keep_last - 1]}
        for _, old in _step_dirs(root):
            if old not in keep:
                trash = root / f".trash-{old.name}-{os.getpid()}"
                os.rename(old, trash)
                shutil.rmtree(trash, ignore_errors=True)
                _reached("pruned")
    return manifest


_T = TypeVar("_T")


def _same_call_on_every_rank(**call: object) -> None:
    """Refuse, on every rank, a collective `load` called with other arguments on some
    rank (another ``resume``, an optimizer on one rank only): rank 0 alone resolves
    the checkpoint, so they would otherwise be ignored."""
    calls: list[object] = [None] * ranks.world_size()
    torch.distributed.all_gather_object(calls, call)
    differing = [r for r, c in enumerate(calls) if c != calls[0]]
    if differing:
        keys = sorted(k for k in call if any(c[k] != calls[0][k] for c in calls))  # type: ignore[index]
        raise CheckpointError(
            f"load is collective and every rank must call it alike, but rank(s) "
            f"{differing} differ from rank 0 in {', '.join(keys)} "
            f"(rank 0: {', '.join(f'{k}={calls[0][k]!r}' for k in keys)})"  # type: ignore[index]
        )


def _together(part: Callable[[], _T]) -> _T:
    """Run this rank's `part`; with a process group, every rank then raises the
    lowest failing rank's error, or all go on (no rank is left waiting in the next
    collective). Without one, errors propagate unchanged."""
    if not ranks.is_collective():
        return part()
    error, result = None, None
    try:
        result = part()
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    message = ranks.agree(error)
    if message is not None:
        raise CheckpointError(message)
    return result  # type: ignore[return-value]


def _class_name(obj: object) -> str:
    cls = type(obj)
    module = cls.__module__
    if module.startswith("mixprec.optim."):
        module = "mixprec.optim"
    elif module.startswith("torch.optim."):
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(files.canonical_json(body).encode()).hexdigest()


def _info(path: Path, manifest: Mapping[str, Any]) -> CheckpointInfo:
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


# ---------------------------------------------------------------------- verify


def _read_manifest(path: Path) -> dict[str, Any]:
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
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
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
    manifest = _read_manifest(path)
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
    return _info(path, manifest)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints under a root (renamed into place), oldest first, unverified."""
    return [p for _, p in _step_dirs(Path(directory))]


def _pointed(root: Path) -> Path | None:
    """The checkpoint `latest` names, if it names one."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _STEP_DIR.match(name) and (root / name).is_dir() else None


def _written_at(path: Path) -> int:
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
            (p for s, p in _step_dirs(root) if p != pointed and (below is None or s < below)),
            key=_written_at,
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


# ------------------------------------------------------------------------ load


def _policy_diff(saved: Mapping[str, Any] | None, precision: Precision | None) -> dict[str, Any]:
    if saved is None or precision is None:
        return {}
    mine = precision.policy.to_dict()
    saved = Policy.saved_fields(saved)
    keys = sorted((set(saved) | set(mine)) - set(_DESCRIPTIVE_FIELDS))
    return {k: (saved.get(k), mine.get(k)) for k in keys if saved.get(k) != mine.get(k)}


def _check_model_state(saved: Mapping[str, Any], model: nn.Module, *, same_dtypes: bool) -> None:
    mine = model.state_dict()
    missing = sorted(set(mine) - set(saved))[:3]
    unexpected = sorted(set(saved) - set(mine))[:3]
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint's model differs: keys missing from it {missing}, unknown here "
            f"{unexpected}: build the model as the run did"
        )
    for key, t in mine.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(t.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(f"model entry {key!r}: saved {got}, here {tuple(t.shape)}")
        if same_dtypes and value.dtype != t.dtype:
            raise CheckpointError(
                f"model entry {key!r}: saved {value.dtype}, here {t.dtype}: prepare the model "
                "as the run did (Precision.prepare), or pass convert=True"
            )


def load(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    resume: str | int = "latest",
    convert: bool = False,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint saved by `save` into a model, optimizer and `Precision`.

    Build them as the run did (same model, `Precision.prepare`, the same param
    groups), then load. Everything is verified (checksums, keys, shapes, the
    policy) before the model or the optimizer change.

    Args:
        directory: the checkpoint root given to `save`, or one checkpoint directory.
        model, optimizer, precision: what to restore (optimizer/precision may be None).
        resume: ``"latest"`` (what ``latest`` names; refused if it does not verify),
            ``"latest-valid"`` (the newest that verifies, warning for each skipped) or
            a step number.
        convert: load a checkpoint saved under another policy or optimizer by
            converting it (masters decoded to fp32 and re-encoded, moments through
            fp32); without it a differing policy is refused, naming the fields.
        restore_rng: restore the torch, CUDA, Python and NumPy RNG states.

    Returns:
        ``{"step", "extra", "path", "policy", "converted"}``: the saved step, the
        caller's ``extra``, the checkpoint read, the saved policy fields, and a list
        of what was converted (empty without conversion).

    Raises:
        CheckpointError: no checkpoint, a damaged one, or one that does not fit.
    """
    model = ranks.unwrap(model)
    if ranks.is_collective():  # rank 0 verifies every file; the verdict goes to all
        _same_call_on_every_rank(
            resume=resume,
            optimizer=optimizer is not None,
            precision=precision is not None,
            convert=convert,
            restore_rng=restore_rng,
        )
        found = _together(lambda: str(resolve(directory, resume).path) if ranks.rank() == 0 else "")
        path = Path(ranks.broadcast(found))
    else:
        path = resolve(directory, resume).path
    manifest, info, diff, kind_differs = _together(
        lambda: _check_setup(path, optimizer, precision, convert)
    )
    names = _param_names(model)
    state = _together(lambda: _read_state(info.path, manifest, model, names))
    converting = bool(diff or kind_differs)
    optimizer_state = _together(
        lambda: _check_state(info.path, state, model, optimizer, names, converting)
    )
    converted = _together(
        lambda: _apply(
            info.path,
            state,
            model,
            optimizer,
            precision,
            names,
            optimizer_state=optimizer_state,
            saved_kind=manifest.get("optimizer"),
            diff=bool(diff),
            convert=convert,
            converting=converting,
        )
    )
    if restore_rng:
        _together(lambda: _restore_rng(info.path, state, info.world_size))
    for line in converted:
        warnings.warn(f"converted {info.path.name}: {line}", CheckpointWarning, stacklevel=2)
    return {
        "step": info.step,
        "extra": state["extra"],
        "path": info.path,
        "policy": manifest.get("policy"),
        "converted": converted,
    }


def _check_setup(
    path: Path,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    convert: bool,
) -> tuple[dict[str, Any], CheckpointInfo, dict[str, Any], bool]:
    """The manifest, refused under another policy or optimizer unless converting.

    Returns (manifest, info, the policy fields that differ, whether the optimizer does)."""
    manifest = _read_manifest(path)
    info = _info(path, manifest)
    diff = _policy_diff(manifest.get("policy"), precision)
    saved_kind = manifest.get("optimizer")
    kind_differs = optimizer is not None and saved_kind not in (None, _class_name(optimizer))
    if (diff or kind_differs) and not convert:
        what = []
        if diff:
            what.append(
                "policy fields "
                + ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in diff.items())
            )
        if kind_differs:
            what.append(f"optimizer (saved {saved_kind}, now {_class_name(optimizer)})")
        raise CheckpointError(
            f"{info.path} was saved under a different setup: {'; '.join(what)}; load under the "
            "same policy, or pass convert=True to convert it"
        )
    return manifest, info, diff, kind_differs


def _read_state(
    path: Path, manifest: Mapping[str, Any], model: nn.Module, names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """The saved state, its tensors read by DCP; with a process group, every tensor
    that is a DTensor here (model entries, and the optimizer state of a DTensor
    parameter) is read as one, sharded like it: DCP reads only this rank's shard."""
    tree = manifest["tree"]
    collective = ranks.is_collective()
    make = None
    if collective:
        live = model.state_dict()
        params = {name: p for p, name in names.items()}

        def like(key: str) -> torch.Tensor | None:
            parts = key.split("/")
            if parts[0] == "model":
                return live.get("/".join(parts[1:]))
            if parts[0] == "optimizer" and len(parts) >= 4 and parts[1] == "state":
                return params.get(parts[2])
            return None

        def make(key: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return ranks.shard_like(size, dtype, like(key))

    try:
        tensors = files.read_dcp(
            path,
            tensor_keys(tree),
            frozenset(manifest["files"]),
            make=make,
            collective=collective,
        )
        return join_tree(tree, tensors)  # type: ignore[no-any-return]
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot read its tensors ({exc})") from None
    except BaseException as exc:  # DCP's CheckpointException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: cannot read its tensors ({first})") from None


def _check_state(
    path: Path,
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    names: Mapping[torch.Tensor, str],
    converting: bool,
) -> dict[str, Any] | None:
    """The model's and the optimizer's saved state checked; the optimizer's by index."""
    _check_model_state(state["model"], model, same_dtypes=not converting)
    if optimizer is None:
        return None
    if state["optimizer"] is None:
        raise CheckpointError(f"{path} holds no optimizer state; pass optimizer=None")
    optimizer_state = _indexed_optimizer_state(state["optimizer"], optimizer, names)
    check = getattr(optimizer, "check_state_dict", None)
    if check is not None and not converting:  # mixprec's AdamW: all of it, changing nothing
        try:
            check(optimizer_state)
        except ValueError as exc:
            raise CheckpointError(f"{path}: optimizer state: {exc}") from None
    return optimizer_state


def _apply(
    path: Path,
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    names: Mapping[torch.Tensor, str],
    *,
    optimizer_state: dict[str, Any] | None,
    saved_kind: str | None,
    diff: bool,
    convert: bool,
    converting: bool,
) -> list[str]:
    """Load the checked state: `Precision`, model, optimizer, in that order."""
    converted: list[str] = []
    if precision is not None and state["precision"] is not None:
        try:  # validated before anything changes (Precision.load_state_dict checks first)
            precision.load_state_dict(state["precision"], strict=not convert)
        except ValueError as exc:
            raise CheckpointError(f"{path}: precision state: {exc}") from None
        if diff:
            converted.append("precision: loss scaler and telemetry carried to the new policy")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: model state: {str(exc).splitlines()[0]}") from None
    if optimizer is not None and optimizer_state is not None:
        from mixprec.checkpoint.convert import load_optimizer

        try:
            converted += load_optimizer(
                optimizer,
                optimizer_state,
                saved_kind=saved_kind,
                saved_model=state["model"],
                names=names,
                convert=converting,
            )
        except ValueError as exc:
            raise CheckpointError(f"{path}: optimizer state: {exc}") from None
    return converted


def _restore_rng(path: Path, state: Mapping[str, Any], saved_world: int) -> None:
    """Each rank's own RNG states when the world size is the one saved; otherwise
    every rank takes rank 0's (and is told so)."""
    me, world = ranks.rank(), ranks.world_size()
    by_rank = state.get("rng_ranks") or {}
    if saved_world == world and (me == 0 or str(me) in by_rank):
        _set_rng_state(state["rng"] if me == 0 else by_rank[str(me)])
        return
    _set_rng_state(state["rng"])
    warnings.warn(
        f"{path.name} was saved by {saved_world} rank(s) and is loaded by {world}: the RNG "
        "streams (torch, Python, NumPy) of every rank restart from rank 0's",
        CheckpointWarning,
        stacklevel=3,
    )
