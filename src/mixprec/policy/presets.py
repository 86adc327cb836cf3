"""Named policies: the presets, other tools' spellings of them, and ``auto``.

Presets come from `preset(name)`, which also accepts other tools' spellings
(Lightning's ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``; Accelerate's
``"fp16"``/``"bf16"``; Composer's ``"amp_bf16"``...).

The ``fp8_*`` presets are ``bf16_master`` (bf16 compute and storage, exact
master, fp32 moments, no loss scaling) with the eligible linear layers in FP8
through torchao's float8 training, one preset per torchao recipe. Every recipe
scales dynamically (current scaling: each cast's scale from that tensor's amax
now); torchao 0.18 has no delayed scaling, whose semantics only the doctor's FP8
probe reproduces. They need torchao (``pip install 'mixprec[fp8]'``) only when a
model is prepared.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from mixprec.device import device_caps
from mixprec.policy.definition import LossScaling, Policy
from mixprec.policy.fp8 import Float8Training

if TYPE_CHECKING:
    from mixprec.speed import SpeedMeasurement

__all__ = [
    "ALIASES",
    "AUTO_CANDIDATES",
    "FP8_PRESET_NAMES",
    "PRESET_NAMES",
    "preset",
    "preset_names",
    "resolve_auto",
]


_BF16 = torch.bfloat16


def _fp8(name: str, recipe: str) -> Policy:
    return Policy(
        name=name,
        compute_dtype=_BF16,
        param_dtype=_BF16,
        master="exact",
        fp8=Float8Training(recipe=recipe),
    )


def _presets() -> dict[str, Callable[[], Policy]]:
    return {
        "fp32": lambda: Policy(name="fp32"),
        "amp_bf16": lambda: Policy(name="amp_bf16", compute_dtype=_BF16),
        "amp_fp16": lambda: Policy(
            name="amp_fp16", compute_dtype=torch.float16, loss_scaling=LossScaling()
        ),
        "fp16_unscaled": lambda: Policy(
            name="fp16_unscaled", compute_dtype=torch.float16, allow_unscaled=True
        ),
        "bf16_master": lambda: Policy(
            name="bf16_master", compute_dtype=_BF16, param_dtype=_BF16, master="exact"
        ),
        "bf16_lean": lambda: Policy(
            name="bf16_lean",
            compute_dtype=_BF16,
            param_dtype=_BF16,
            master="remainder8",
            moments="int8",
        ),
        "bf16_lean4": lambda: Policy(
            name="bf16_lean4",
            compute_dtype=_BF16,
            param_dtype=_BF16,
            master="remainder8",
            moments="int4",
            release_gradients=True,
        ),
        "bf16_kahan": lambda: Policy(
            name="bf16_kahan",
            compute_dtype=_BF16,
            param_dtype=_BF16,
            master="kahan",
            moments="bf16",
        ),
        "bf16_sr": lambda: Policy(
            name="bf16_sr",
            compute_dtype=_BF16,
            param_dtype=_BF16,
            master="stochastic",
            moments="bf16",
        ),
        "bf16_pure": lambda: Policy(
            name="bf16_pure",
            compute_dtype=_BF16,
            param_dtype=_BF16,
            master="none",
            moments="bf16",
        ),
        "fp8_tensorwise": lambda: _fp8("fp8_tensorwise", "tensorwise"),
        "fp8_rowwise": lambda: _fp8("fp8_rowwise", "rowwise"),
        "fp8_rowwise_gw_hp": lambda: _fp8("fp8_rowwise_gw_hp", "rowwise_with_gw_hp"),
    }


#: The preset names, in table order (``auto`` resolves to one of them per device).
PRESET_NAMES: tuple[str, ...] = (
    "fp32",
    "amp_bf16",
    "amp_fp16",
    "fp16_unscaled",
    "bf16_master",
    "bf16_lean",
    "bf16_lean4",
    "bf16_kahan",
    "bf16_sr",
    "bf16_pure",
    "fp8_tensorwise",
    "fp8_rowwise",
    "fp8_rowwise_gw_hp",
)

#: The presets whose linear layers train in FP8 (`Policy.fp8`), in table order.
FP8_PRESET_NAMES: tuple[str, ...] = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp")

#: Other tools' spellings and the preset each means. Lookup ignores case and treats
#: "-" and "_" alike.
ALIASES: dict[str, str] = {
    # PyTorch Lightning / Fabric
    "32": "fp32",
    "32-true": "fp32",
    "16": "amp_fp16",
    "16-mixed": "amp_fp16",
    "bf16": "amp_bf16",
    "bf16-mixed": "amp_bf16",
    "bf16-true": "bf16_pure",
    # Hugging Face Accelerate / Trainer
    "no": "fp32",
    "fp16": "amp_fp16",
    # MosaicML Composer and common spellings
    "float32": "fp32",
    "full": "fp32",
    "amp": "amp_fp16",
    "fp16-mixed": "amp_fp16",
    "mixed_fp16": "amp_fp16",
    "mixed_bf16": "amp_bf16",
    "pure_bf16": "bf16_pure",
    "bf16_master_weights": "bf16_master",
    "stochastic_rounding": "bf16_sr",
}


def preset_names(include_auto: bool = True) -> tuple[str, ...]:
    """The valid preset names (and ``auto``)."""
    return (*PRESET_NAMES, "auto") if include_auto else PRESET_NAMES


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def preset(name: str | Policy, *, device: torch.device | str | None = None) -> Policy:
    """The preset called `name` (or an alias of it); ``"auto"`` picks one for `device`.

    Args:
        name: a preset name (`PRESET_NAMES`), ``"auto"``, another tool's spelling
            (`ALIASES`), or a `Policy`, returned unchanged.
        device: the device ``"auto"`` decides for (default: CUDA if available, else CPU).

    Raises:
        ValueError: for an unknown name, listing the valid names and aliases.
    """
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str):
        raise TypeError(f"policy name must be a string or a Policy, got {name!r}")
    key = _normalize(name)
    if key == "auto":
        return resolve_auto(device)
    key = {_normalize(a): t for a, t in ALIASES.items()}.get(key, key)
    factories = _presets()
    if key not in factories:
        raise ValueError(
            f"unknown precision policy {name!r}{_did_you_mean(key)}; valid presets: "
            f"{', '.join(preset_names())}; aliases: {', '.join(sorted(ALIASES))}"
        )
    return factories[key]()


def _did_you_mean(key: str) -> str:
    """`` (did you mean 'bf16_master'?)`` for the closest preset or alias, or nothing."""
    names = {_normalize(n): n for n in (*preset_names(), *ALIASES)}
    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean {names[close[0]]!r}?)" if close else ""


#: What a measured `auto` may choose: the compute format it measured fastest, and the
#: preset that computes in it with everything else at its safe default (fp32 storage,
#: fp32 optimizer state, dynamic loss scaling for fp16). Never a 16-bit-storage preset
#: (a memory decision), never fp16 without loss scaling.
AUTO_CANDIDATES: Mapping[str, str] = MappingProxyType(
    {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp_fp16"}
)


def resolve_auto(
    device: torch.device | str | None = None,
    *,
    measured: SpeedMeasurement | None = None,
    margin: float | None = None,
) -> Policy:
    """The policy ``"auto"`` means on `device`, with the reason in `Policy.note`.

    With `measured` (from `mixprec.speed.measure_speed`: step times of this model
    or these shapes on this device), the preset of the fastest format
    (`AUTO_CANDIDATES`): a 16-bit format only if its step takes at most
    ``1 - margin`` of fp32's (`margin` defaults to `mixprec.speed.DEFAULT_MARGIN`,
    10%), and fp16 over bf16 only if it is faster by the same margin again (bf16
    needs no loss scaling).

    Without it, from device facts: bf16 autocast (fp32 storage) where bf16
    matmuls have hardware (Ampere+ GPUs, CPUs with AVX512-BF16 or AMX); fp16
    autocast with dynamic loss scaling on GPUs with fast fp16 but no fast bf16;
    fp32 otherwise. Hardware does not make a small model's step faster: measure
    when you can.

    Storage stays fp32 either way: moving it to 16 bits is a memory decision `auto`
    does not make for you.

    Raises:
        ValueError: `measured` was taken on another device than `device`.
    """
    if measured is not None:
        if device is not None and not _same_device(torch.device(device), measured.device):
            raise ValueError(
                f"the speed was measured on {measured.device}, not on {torch.device(device)}"
            )
        how = {} if margin is None else {"margin": margin}
        chosen = AUTO_CANDIDATES[measured.choice(**how)]
        note = f"auto chose {chosen} on {measured.device_name}, measured: {measured.explain(**how)}"
        return dataclasses.replace(preset(chosen), note=note)
    caps = device_caps(device)
    if caps.bf16_fast and caps.bf16_supported:
        chosen, why = "amp_bf16", caps.bf16_reason
    elif caps.device_type != "cpu" and caps.fp16_fast:
        chosen, why = "amp_fp16", f"{caps.fp16_reason}; {caps.bf16_reason}"
    else:
        chosen, why = "fp32", f"{caps.bf16_reason}; {caps.fp16_reason}"
    base = preset(chosen)
    return dataclasses.replace(
        base,
        note=f"auto chose {chosen} on {caps.name} from device facts, nothing measured: {why}",
    )


def _same_device(asked: torch.device, measured: str) -> bool:
    where = torch.device(measured)
    if asked.type != where.type:
        return False
    return asked.index is None or where.index is None or asked.index == where.index
