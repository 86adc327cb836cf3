"""`save`: the whole training state, exactly, atomically, verified.

A save writes ``root/.tmp-step_<N>-<pid>/`` (DCP's files, flushed, then
``manifest.json`` with a checksum per file), renames it to ``step_<N>``, then
replaces ``latest`` through a flushed temporary file, then removes checkpoints
beyond ``keep_last`` (the layout: `mixprec.checkpoint.layout`). A crash at any
point leaves the previous ``latest`` pointing at a complete checkpoint; leftovers
of an unfinished save (``.tmp-*``, ``.trash-*``) are never read and are removed by
the next save.

What is saved: the model's state dict (storage dtypes), the optimizer's state
dict keyed by parameter name (mixprec's masters and moments in their own
representation: remainders, Kahan buffers, int8 codes and scales, step counters
and rounding seeds), `Precision`'s scaler and telemetry, the RNG states of torch
(CPU and CUDA), Python and NumPy, the step, the policy, and the caller's
``extra`` (tensors, numbers, strings, lists and dicts: e.g. the data position or
a scheduler's state dict).

With a process group (FSDP2, DDP), `save` is collective: every rank calls it (see
`mixprec.checkpoint.ranks`). DCP writes each rank's DTensor shards and rank 0's
plain tensors (replicated state, saved once) into one temporary directory; rank 0
alone writes the manifest, renames and moves ``latest`` after every rank's data is
written. Each rank's RNG states are saved under their own keys.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.checkpoint import files, ranks
from mixprec.checkpoint.files import MANIFEST, TreeError, split_tree
from mixprec.checkpoint.layout import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    CheckpointError,
    CheckpointInfo,
    checkpoint_info,
    class_name,
    manifest_digest,
    remove_leftovers,
    step_dirs,
    written_at,
)
from mixprec.checkpoint.ranks import together
from mixprec.checkpoint.state import named_optimizer_state, param_names, rng_state
from mixprec.formats import master_state_keys, moment_state_keys
from mixprec.optim.sharding import is_dtensor
from mixprec.version import __version__

if TYPE_CHECKING:
    from mixprec.engine import Precision

__all__ = ["save"]


def _reached(phase: str) -> None:
    """Called as a save passes each of its steps (a seam for fault-injection tests)."""


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
    state = together(lambda: _collect(root, model, optimizer, precision, step, extra, keep_last))
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
    tmp = Path(ranks.broadcast(together(lambda: _make_tmp(root, name) if me == 0 else "")))
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
    return checkpoint_info(root / name, manifest)


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
    names = param_names(model)
    me = ranks.rank()
    tensors: dict[str, torch.Tensor] = {}
    try:
        tree = {
            "model": split_tree(dict(model.state_dict()), "model", tensors),
            "optimizer": None
            if optimizer is None
            else split_tree(named_optimizer_state(optimizer, names), "optimizer", tensors),
            "precision": None
            if precision is None
            else split_tree(precision.state_dict(), "precision", tensors),
            "extra": split_tree(dict(extra or {}), "extra", tensors),
        }
        before = set(tensors)
        # Each rank's RNG states under a key of its own; rank 0's where one process
        # keeps them (a single-process load restores those).
        tree["rng_mine"] = split_tree(rng_state(), "rng" if me == 0 else f"rng_ranks/{me}", tensors)
    except TreeError as exc:
        raise CheckpointError(f"cannot save {exc}") from None
    return step, tree, tensors, frozenset(set(tensors) - before)


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a whole number >= 0, got {step!r}")
    return step


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
    remove_leftovers(root)
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
        "optimizer": None if optimizer is None else class_name(optimizer),
        "components": components,
        "files": {
            f.name: {"bytes": f.stat().st_size, "sha256": files.file_digest(f)}
            for f in sorted(tmp.iterdir())
        },
        "tree": tree,
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
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
            (p for s, p in step_dirs(root) if s <= step and p != final),
            key=written_at,
            reverse=True,
        )
        keep = {final, *line[: keep_last - 1]}
        for _, old in step_dirs(root):
            if old not in keep:
                trash = root / f".trash-{old.name}-{os.getpid()}"
                os.rename(old, trash)
                shutil.rmtree(trash, ignore_errors=True)
                _reached("pruned")
    return manifest


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
