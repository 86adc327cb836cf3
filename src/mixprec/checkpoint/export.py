"""Export a model's true weights as one consolidated safetensors file.

`export` writes the model's ``state_dict()`` keys with the values training
actually holds: a parameter the optimizer keeps a master for is written from
that master (`mixprec.optim.AdamW.master_weights`), not from its rounded 16-bit
copy. Everything else (frozen parameters, parameters of a plain torch
optimizer, buffers) comes from the model.

Rules, in one place:

* Path: a path ending in ``.safetensors`` is the file; any other path is a
  directory (created if missing) that receives ``model.safetensors``, plus
  ``config.json`` when the model has a HuggingFace-style ``config`` (so
  ``from_pretrained(directory)`` works).
* Dtype: ``fp32``, ``bf16`` or ``fp16`` (any `parse_dtype` spelling of them, or
  the torch dtypes). Casts round to
  nearest even (``Tensor.to``). A cast that turns a finite value into inf is
  refused, naming the key and its largest magnitude.
* fp32 islands: if the model stores any parameter in 16 bits, every floating
  tensor it stores in fp32 is an island (norms kept fp32 by the policy, fp32
  buffers) and stays fp32 in a 16-bit export, unless ``fp32_islands="cast"``.
  A model stored all in fp32 has no islands: a 16-bit export casts everything.
* Tied weights: every key is written, each with its own copy (safetensors
  refuses shared storage), so ``load_state_dict(strict=True)`` works.
* The file is written to a temporary file in the same directory, flushed,
  fsynced and renamed into place (`mixprec.checkpoint.files.atomic_path`):
  ``path`` holds either the old file or the complete new one, with the mode any
  new file gets (the umask's). Every check runs before anything is written.
* A `DistributedDataParallel` model is exported under its module's keys (no
  ``module.`` prefix), as the unwrapped model would be.
* Sharded (DTensor) values are gathered with ``full_tensor()`` on every rank;
  with a process group, only rank 0 writes and the other ranks return right
  after the gather, without waiting for the write.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from mixprec.checkpoint.files import atomic_path
from mixprec.checkpoint.ranks import unwrap
from mixprec.dtypes import DtypeLike, dtype_name, is_16bit, parse_dtype
from mixprec.optim.sharding import is_dtensor
from mixprec.policy import Policy
from mixprec.version import __version__

__all__ = ["EXPORT_DTYPES", "ExportInfo", "HasMasterWeights", "export"]

#: The export dtypes, by the name `export` accepts and writes in the metadata.
EXPORT_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

#: File name inside a directory export (what ``from_pretrained`` looks for).
MODEL_FILE = "model.safetensors"

# Metadata keys export writes itself; `extra_metadata` may not override them.
_RESERVED_KEYS = frozenset(
    {"format", "mixprec_version", "dtype", "source", "model_params", "islands", "policy", "step"}
)

# HuggingFace's spelling of each export dtype in config.json.
_HF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@runtime_checkable
class HasMasterWeights(Protocol):
    """An optimizer that reports the fp32 master of each parameter (`mixprec.optim.AdamW`)."""

    param_groups: list[dict[str, Any]]

    def master_weights(self) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class ExportInfo:
    """What `export` wrote.

    Attributes:
        path: the safetensors file.
        dtype: the export dtype.
        bytes: size of the file (0 on ranks other than 0, which do not write).
        tensors: number of keys written.
        from_master: number of keys whose values came from the optimizer's master.
        islands: keys kept in fp32 in a 16-bit export, in ``state_dict`` order.
        config_path: the ``config.json`` written beside it, or None.
        written: whether this process wrote the files (False on ranks other than 0).
    """

    path: Path
    dtype: torch.dtype
    bytes: int
    tensors: int
    from_master: int
    islands: tuple[str, ...]
    config_path: Path | None
    written: bool


def export(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    dtype: DtypeLike = "fp32",
    *,
    fp32_islands: Literal["keep", "cast"] = "keep",
    policy: Policy | None = None,
    step: int | None = None,
    extra_metadata: Mapping[str, str] | None = None,
) -> ExportInfo:
    """Write the model's weights, from the optimizer's masters, as safetensors.

    Args:
        model: the trained model; its ``state_dict()`` keys are the file's keys.
        optimizer: an optimizer with ``master_weights()`` (`mixprec.optim.AdamW`)
            gives the values of its parameters; a plain torch optimizer, or None,
            means the model's own values.
        path: a ``.safetensors`` file, or a directory that receives
            ``model.safetensors`` (and ``config.json`` for a HuggingFace model).
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or the matching torch dtype.
        fp32_islands: ``"keep"`` leaves fp32-stored tensors of a 16-bit model in
            fp32 in a 16-bit export; ``"cast"`` casts them too.
        policy: the run's policy, recorded as JSON in the metadata.
        step: the training step, recorded in the metadata.
        extra_metadata: more string metadata (may not reuse export's own keys).

    Returns:
        An `ExportInfo` describing the file.

    Raises:
        ValueError: an unknown dtype or ``fp32_islands``, a path that is an
            existing file not ending in ``.safetensors``, metadata reusing a
            reserved key, an optimizer whose masters do not match its
            parameters, or a value that would overflow to inf in `dtype`.
        TypeError: a dtype that is neither a string nor a `torch.dtype`, or
            metadata that is not ``str -> str``.
        ImportError: safetensors is not installed.
    """
    save_file = _safetensors_save_file()
    target = _export_dtype(dtype)
    if fp32_islands not in ("keep", "cast"):
        raise ValueError(f"fp32_islands={fp32_islands!r}; valid choices: 'keep', 'cast'")
    file, directory = _resolve_path(Path(path))
    extra = _check_extra_metadata(extra_metadata)
    writer = _is_writer()
    model = unwrap(model)  # DDP's "module." is not part of the model's names

    masters = _masters_by_param(optimizer)
    named = model.state_dict(keep_vars=True)
    has_16bit = any(is_16bit(p.dtype) for p in model.parameters())
    keep_islands = is_16bit(target) and fp32_islands == "keep" and has_16bit
    param_ids = {id(p) for p in model.parameters()}

    tensors: dict[str, torch.Tensor] = {}
    islands: list[str] = []
    model_params: list[str] = []
    from_master = 0
    for key, stored in named.items():
        source = masters.get(id(stored))
        if source is None:
            if id(stored) in param_ids:
                model_params.append(key)
            source = stored.detach()
        else:
            from_master += 1
        full = _full(source)
        if not writer:
            continue  # the gather above is collective; only rank 0 keeps values
        if not full.is_floating_point():
            tensors[key] = full.to("cpu", copy=True).contiguous()
            continue
        if keep_islands and stored.dtype == torch.float32:
            islands.append(key)
            tensors[key] = full.to("cpu", torch.float32, copy=True).contiguous()
            continue
        tensors[key] = _cast_checked(key, full, target)

    if not writer:
        return ExportInfo(file, target, 0, len(named), from_master, (), None, written=False)

    metadata = {
        "format": "pt",  # HuggingFace's loader requires it
        "mixprec_version": __version__,
        "dtype": dtype_name(target),
        "source": _summary(from_master, len(model_params)),
        "islands": json.dumps(islands),
        **({"model_params": json.dumps(model_params)} if from_master and model_params else {}),
        **({"policy": json.dumps(policy.to_dict())} if policy is not None else {}),
        **({"step": str(step)} if step is not None else {}),
        **extra,
    }
    file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(file) as tmp:
        save_file(tensors, tmp, metadata=metadata)
        _sort_metadata(tmp)
    config_path = _save_config(model, directory, target) if directory is not None else None
    return ExportInfo(
        path=file,
        dtype=target,
        bytes=file.stat().st_size,
        tensors=len(tensors),
        from_master=from_master,
        islands=tuple(islands),
        config_path=config_path,
        written=True,
    )


# ------------------------------------------------------------------ arguments


def _safetensors_save_file() -> Callable[..., None]:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            "mixprec.checkpoint.export writes safetensors files: pip install safetensors"
        ) from e
    return save_file


def _export_dtype(dtype: DtypeLike) -> torch.dtype:
    """The export dtype, through `parse_dtype` (the one place strings become dtypes)."""
    valid = "'fp32', 'bf16', 'fp16' (or torch.float32, torch.bfloat16, torch.float16)"
    try:
        parsed: torch.dtype | None = parse_dtype(dtype)
    except ValueError:
        parsed = None
    except TypeError as e:
        raise TypeError(f"export dtype {dtype!r} is not a dtype; valid choices: {valid}") from e
    if parsed not in EXPORT_DTYPES.values():
        raise ValueError(f"export dtype {dtype!r} is not supported; valid choices: {valid}")
    assert parsed is not None
    return parsed


def _resolve_path(path: Path) -> tuple[Path, Path | None]:
    """(the safetensors file, the directory export or None for a file export)."""
    if path.suffix == ".safetensors" and not path.is_dir():
        return path, None
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"export path {str(path)!r} is an existing file that does not end in "
            "'.safetensors'; give a '.safetensors' file or a directory"
        )
    return path / MODEL_FILE, path


def _check_extra_metadata(extra: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(extra or {})
    for key, value in out.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"extra_metadata must map str to str (safetensors metadata), got "
                f"{key!r}: {type(value).__name__}"
            )
    clash = sorted(_RESERVED_KEYS.intersection(out))
    if clash:
        raise ValueError(
            f"extra_metadata reuses keys export writes itself: {clash}; "
            f"reserved: {sorted(_RESERVED_KEYS)}"
        )
    return out


# ------------------------------------------------------------------ values


def _masters_by_param(optimizer: torch.optim.Optimizer | None) -> dict[int, torch.Tensor]:
    """id(parameter) -> its fp32 master, for an optimizer that has masters."""
    if not isinstance(optimizer, HasMasterWeights):
        return {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    masters = optimizer.master_weights()
    if len(masters) != len(params):
        raise ValueError(
            f"{type(optimizer).__name__}.master_weights() gave {len(masters)} tensors for "
            f"{len(params)} parameters"
        )
    return {id(p): m for p, m in zip(params, masters, strict=True)}


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor is gathered (a collective: every rank calls it)."""
    if is_dtensor(t):
        return t.full_tensor()  # type: ignore[attr-defined,no-any-return]
    return t


def _cast_checked(key: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`value` on the CPU in `dtype` (round to nearest even), refusing new infs."""
    out = value.to("cpu", dtype, copy=True).contiguous()
    if dtype != value.dtype and torch.isinf(out).any():
        overflow = torch.isinf(out) & torch.isfinite(value.to("cpu"))
        if overflow.any():
            peak = value.to("cpu", torch.float64).abs()[overflow].max().item()
            raise ValueError(
                f"tensor {key!r} overflows {dtype_name(dtype)}: max |value| {peak:.6g} > "
                f"{torch.finfo(dtype).max:.6g}; export in a wider dtype (fp32 or bf16)"
            )
    return out


def _summary(from_master: int, model_params: int) -> str:
    if from_master and not model_params:
        return "master"
    if not from_master:
        return "model"
    return "mixed"


# ------------------------------------------------------------------ writing


def _is_writer() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _sort_metadata(path: Path) -> None:
    """Rewrite the safetensors header of `path` in place with its metadata keys sorted.

    safetensors keeps the metadata in a Rust hash map, so the order of its keys in
    the header changes from one call to the next; the tensors are already in a
    fixed order (by dtype alignment, then name). Sorted, equal weights and
    metadata give the same bytes (a resumed run exports what the uninterrupted
    one does). The JSON is as long as before (the same keys and values, escaped
    alike by serde_json and Python), so nothing else moves.
    """
    with path.open("rb+") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size)
        header = json.loads(raw)
        metadata = header.pop("__metadata__", None)
        ordered = {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}
        text = json.dumps({**ordered, **header}, separators=(",", ":"), ensure_ascii=False)
        canonical = text.encode("utf-8")
        assert len(canonical) <= size, "safetensors header grew when its keys were sorted"
        f.seek(8)
        f.write(canonical.ljust(size, b" "))


def _save_config(model: nn.Module, directory: Path, dtype: torch.dtype) -> Path | None:
    """Write a HuggingFace model's ``config.json`` (with the export dtype) beside the file.

    The config is copied, never changed on the model. It records the export dtype
    because ``from_pretrained`` loads with ``dtype="auto"`` (the config's) by default.
    """
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return None
    config = copy.deepcopy(config)
    if hasattr(config, "dtype"):
        config.dtype = _HF_DTYPE[dtype]
    if hasattr(config, "architectures"):
        config.architectures = [type(model).__name__]
    with tempfile.TemporaryDirectory(dir=directory, prefix=".config.") as staging:
        config.save_pretrained(staging)
        for item in sorted(Path(staging).iterdir()):
            with atomic_path(directory / item.name) as tmp:
                tmp.write_bytes(item.read_bytes())
    target = directory / "config.json"
    return target if target.exists() else None
