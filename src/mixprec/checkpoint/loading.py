"""`load`: a checkpoint back into a model, optimizer and `Precision`, verified first.

A load finds the checkpoint (`mixprec.checkpoint.layout.resolve`: every file's
checksum verified), compares the saved policy and optimizer class with the live
ones (refused, or converted with ``convert=True``), reads the tensors with DCP,
checks the model's keys, shapes and dtypes and the optimizer's whole state, and
only then loads the `Precision`, the model, the optimizer and the RNG states: a
checkpoint that does not fit changes nothing.

With a process group (FSDP2, DDP), `load` is collective: every rank calls it alike
(see `mixprec.checkpoint.ranks`). Rank 0 verifies the files; every DTensor is read
as a DTensor sharded like the live one, so DCP reshards across world sizes (a
process group of 2 to one process and back).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.checkpoint import files, ranks
from mixprec.checkpoint.files import join_tree, tensor_keys
from mixprec.checkpoint.layout import (
    CheckpointError,
    CheckpointInfo,
    CheckpointWarning,
    checkpoint_info,
    class_name,
    read_manifest,
    resolve,
)
from mixprec.checkpoint.ranks import together
from mixprec.checkpoint.state import indexed_optimizer_state, param_names, set_rng_state

if TYPE_CHECKING:
    from mixprec.engine import Precision

__all__ = ["load"]


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
        found = together(lambda: str(resolve(directory, resume).path) if ranks.rank() == 0 else "")
        path = Path(ranks.broadcast(found))
    else:
        path = resolve(directory, resume).path
    manifest, info, diff, kind_differs = together(
        lambda: _check_setup(path, optimizer, precision, convert)
    )
    names = param_names(model)
    state = together(lambda: _read_state(info.path, manifest, model, names))
    converting = bool(diff or kind_differs)
    optimizer_state = together(
        lambda: _check_state(info.path, state, model, optimizer, names, converting)
    )
    converted = together(
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
        together(lambda: _restore_rng(info.path, state, info.world_size))
    for line in converted:
        warnings.warn(f"converted {info.path.name}: {line}", CheckpointWarning, stacklevel=2)
    return {
        "step": info.step,
        "extra": state["extra"],
        "path": info.path,
        "policy": manifest.get("policy"),
        "converted": converted,
    }


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


def _check_setup(
    path: Path,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision | None,
    convert: bool,
) -> tuple[dict[str, Any], CheckpointInfo, dict[str, Any], bool]:
    """The manifest, refused under another policy or optimizer unless converting.

    Returns (manifest, info, the policy fields that differ, whether the optimizer does)."""
    manifest = read_manifest(path)
    info = checkpoint_info(path, manifest)
    diff = _policy_diff(manifest.get("policy"), precision)
    saved_kind = manifest.get("optimizer")
    kind_differs = optimizer is not None and saved_kind not in (None, class_name(optimizer))
    if (diff or kind_differs) and not convert:
        what = []
        if diff:
            what.append(
                "policy fields "
                + ", ".join(f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in diff.items())
            )
        if kind_differs:
            what.append(f"optimizer (saved {saved_kind}, now {class_name(optimizer)})")
        raise CheckpointError(
            f"{info.path} was saved under a different setup: {'; '.join(what)}; load under the "
            "same policy, or pass convert=True to convert it"
        )
    return manifest, info, diff, kind_differs


def _policy_diff(saved: Mapping[str, Any] | None, precision: Precision | None) -> dict[str, Any]:
    if saved is None or precision is None:
        return {}
    return precision.policy.differences(saved)


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
    optimizer_state = indexed_optimizer_state(state["optimizer"], optimizer, names)
    check = getattr(optimizer, "check_state_dict", None)
    if check is not None and not converting:  # mixprec's AdamW: all of it, changing nothing
        try:
            check(optimizer_state)
        except ValueError as exc:
            raise CheckpointError(f"{path}: optimizer state: {exc}") from None
    return optimizer_state


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
        set_rng_state(state["rng"] if me == 0 else by_rank[str(me)])
        return
    set_rng_state(state["rng"])
    warnings.warn(
        f"{path.name} was saved by {saved_world} rank(s) and is loaded by {world}: the RNG "
        "streams (torch, Python, NumPy) of every rank restart from rank 0's",
        CheckpointWarning,
        stacklevel=3,
    )
