"""mixprec's own YAML config, read into `TrainingFacts`.

Schema (every section optional except ``precision``; unknown keys are ignored
except inside ``precision``, which `mixprec.Policy.from_dict` validates)::

    precision:              # a Policy: preset + field overrides (Policy.from_dict)
      preset: bf16_master
    optimizer:
      name: mixprec.optim.AdamW   # adamw, adam, sgd, lion (mixprec's), or torch.optim.SGD,
                                  # torch.optim.AdamW, ... (torch's: no master)
      args: {momentum: 0.9}       # its keyword arguments that decide its state
                                  # (momentum, nesterov, amsgrad)
      master: exact               # overrides precision.master (mixprec's optimizers)
      moments: fp32               # overrides precision.moments (mixprec's optimizers)
    distributed:
      reduce_dtype: fp32          # overrides precision.reduce_dtype
    training:
      steps: 20000                # planned optimizer steps
      peft: false                 # only adapters train
    fp8:
      enabled: false
      scaling: tensorwise         # tensorwise | rowwise | rowwise_with_gw_hp | blockwise |
                                  # delayed | current | none
    device: cuda                  # a device name, or {type, name, bf16_fast, fp16_fast,
                                  # bf16_supported, fp16_supported, fp8_fast} for a target
                                  # machine (fp8_fast: FP8 units; default false)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import (
    GroupFacts,
    OptimizerFacts,
    TrainingFacts,
    resolve_mixprec_master,
)
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.optimizers import (
    MIXPREC_TARGETS,
    TORCH_TARGETS,
    mixprec_state,
    torch_optimizer_facts,
)
from mixprec.floats import canonical_name, is_16bit_name

if TYPE_CHECKING:
    from mixprec.device import DeviceCaps
    from mixprec.policy import Policy

# A mixprec config is validated by building the Policy the run will use, so reading
# one imports torch (the policy, the format registry, the device probe), inside the
# functions below: detecting the format, and every other front end, stays torch-free.

__all__ = [
    "FP8_SCALINGS",
    "FRONT_END",
    "NORM_CLASS_NAMES",
    "OPTIMIZER_NAMES",
    "claims_mixprec",
    "facts_from_mixprec",
    "policy_from_config",
]

#: fp8 scaling recipes a mixprec config may name (``none``: no scaling).
FP8_SCALINGS: tuple[str, ...] = (
    "tensorwise",
    "rowwise",
    "rowwise_with_gw_hp",
    "blockwise",
    "delayed",
    "current",
    "none",
)

#: Optimizer names a mixprec config may use (lowercased), and the class each names: a
#: short name is mixprec's own (as ``mixprec compare --optimizer`` takes it), a
#: ``torch.optim`` name torch's, which keeps its state in the parameters' dtype and has
#: no master.
OPTIMIZER_NAMES: dict[str, str] = {
    "mixprec": "mixprec.optim.AdamW",
    **{name.lower(): name for name in MIXPREC_TARGETS},
    **{name.rsplit(".", 1)[-1].lower(): name for name in MIXPREC_TARGETS},
    **{name.lower(): name for name in TORCH_TARGETS if name.count(".") == 2},
}

#: Class names of common norm layers, matched against ``fp32_modules`` patterns.
NORM_CLASS_NAMES: tuple[str, ...] = (
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "LlamaRMSNorm",
)


def policy_from_config(
    raw: Mapping[str, Any], *, where: str = "precision"
) -> tuple[Policy, str, bool]:
    """The `Policy` of a ``precision:`` mapping, the master it asks for, and whether it
    allows fp16 without scaling.

    The mapping goes through `Policy.from_dict` (strings become dtypes there). Its
    ``master`` and ``allow_unscaled`` are read apart so that combinations the doctor
    reports as findings (a master over fp32 params, fp16 without scaling) do not abort
    the check as Policy's own validation would.

    Raises:
        ValueError: for unknown keys or values, prefixed with `where`.
    """
    from mixprec.formats import check_master
    from mixprec.policy import Policy, preset

    data = dict(raw)
    master_raw = data.pop("master", None)
    allow_raw = data.pop("allow_unscaled", False)
    if not isinstance(allow_raw, bool):
        raise ValueError(f"{where}: allow_unscaled must be true or false, got {allow_raw!r}")
    try:
        preset_master = preset(str(data["preset"])).master if "preset" in data else "none"
        pol = Policy.from_dict({**data, "master": "none", "allow_unscaled": True})
        master = check_master(str(master_raw)) if master_raw is not None else preset_master
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return pol, master, allow_raw


def _device(doc: ConfigDoc) -> DeviceCaps | None:
    import torch

    from mixprec.device import DeviceCaps, device_caps

    raw = doc.get("device")
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            kind = torch.device(raw).type
        except (RuntimeError, ValueError):
            raise ValueError(
                f"{doc.loc('device')}: unknown device {raw!r}; give cpu, cuda, cuda:N, mps, "
                "or a mapping describing the target (see docs/doctor.md)"
            ) from None
        if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()):
            return device_caps(raw)
        return None  # not on this machine: describe it as a mapping to judge it
    if isinstance(raw, Mapping):
        flags: dict[str, bool] = {}
        for key in ("bf16_supported", "fp16_supported", "bf16_fast", "fp16_fast", "fp8_fast"):
            value = raw.get(key, key != "fp8_fast")  # fp8 units only when declared
            if not isinstance(value, bool):
                raise ValueError(f"{doc.loc('device.' + key)}: must be true or false")
            flags[key] = value
        kind = str(raw.get("type", "cuda"))
        name = str(raw.get("name", kind))
        declared = f"declared in {doc.source}"
        return DeviceCaps(
            device_type=kind,
            name=name,
            bf16_reason=f"bf16 {'fast' if flags['bf16_fast'] else 'not fast'} on {name} "
            f"({declared})",
            fp16_reason=f"fp16 {'fast' if flags['fp16_fast'] else 'not fast'} on {name} "
            f"({declared})",
            fp8_reason=f"fp8 {'fast' if flags['fp8_fast'] else 'emulated (no FP8 units)'} on "
            f"{name} ({declared}: fp8_fast)",
            bf16_supported=flags["bf16_supported"],
            fp16_supported=flags["fp16_supported"],
            bf16_fast=flags["bf16_fast"],
            fp16_fast=flags["fp16_fast"],
            fp8_fast=flags["fp8_fast"],
        )
    raise ValueError(f"{doc.loc('device')}: device must be a name or a mapping, got {raw!r}")


def _optimizer(doc: ConfigDoc, pol: Policy, master: str) -> OptimizerFacts:
    from mixprec.formats import check_master, check_moments

    section = doc.mapping("optimizer") or {}
    raw_name = str(section.get("name", "mixprec.optim.AdamW"))
    name = OPTIMIZER_NAMES.get(raw_name.strip().lower())
    if name is None:
        raise ValueError(
            f"{doc.loc('optimizer.name')}: unknown optimizer {raw_name!r}; valid: "
            f"{', '.join(sorted(OPTIMIZER_NAMES))}"
        )
    options = doc.mapping("optimizer.args") or {}
    storage = canonical_name(pol.param_dtype)
    if name in MIXPREC_TARGETS:
        state = mixprec_state(MIXPREC_TARGETS[name], options)
        try:
            if "master" in section:
                raw_master = str(section["master"])
                master = resolve_mixprec_master(
                    raw_master if raw_master == "auto" else check_master(raw_master), storage
                )
            moments = (
                check_moments(str(section["moments"])) if "moments" in section else pol.moments
            )
        except ValueError as exc:
            raise ValueError(f"{doc.loc('optimizer')}: {exc}") from exc
        group = GroupFacts(param_dtype=storage, master=master, moments=moments if state else "none")
        return OptimizerFacts(name=name, state=state, groups=(group,))
    facts = torch_optimizer_facts(name, storage, options)
    assert facts is not None  # every torch name of OPTIMIZER_NAMES is one
    return facts


def _norms_covered(pol: Policy) -> tuple[bool, tuple[str, ...]]:
    from mixprec.islands import IslandRule

    rule = IslandRule.of(pol)
    uncovered = tuple(n for n in NORM_CLASS_NAMES if not rule.covers_class_name(n))
    return not uncovered, uncovered


def facts_from_mixprec(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read a mixprec YAML config into `TrainingFacts`.

    Raises:
        ValueError: for a missing/invalid ``precision`` mapping or invalid values.
    """
    from mixprec.policy import preset

    raw = doc.mapping("precision")
    if raw is None:
        raise ValueError(f"{doc.source}: a mixprec config needs a top-level 'precision:' mapping")
    pol, master, allow_unscaled = policy_from_config(raw, where=doc.loc("precision"))

    def prec_loc(key: str) -> str:
        return doc.loc(f"precision.{key}", "precision.preset", "precision")

    where: dict[str, str] = {
        "param_dtype": prec_loc("param_dtype"),
        "compute_dtype": prec_loc("compute_dtype"),
        "loss_scaling": prec_loc("loss_scaling"),
        "master": doc.loc("optimizer.master", "precision.master", "precision.preset", "precision"),
        "optimizer": doc.loc("optimizer.name", "optimizer", "precision.preset", "precision"),
        "reduce_dtype": doc.loc(
            "distributed.reduce_dtype", "precision.reduce_dtype", "precision.preset", "precision"
        ),
        "norms": prec_loc("fp32_modules"),
        "fp8": doc.loc("fp8.scaling", "fp8.enabled", "fp8"),
        "device": doc.loc("device"),
    }
    optimizer = _optimizer(doc, pol, master)

    # `loss_scaling: null` over a preset that scales: the line to fix is that key.
    off_by = ""
    scaling_nulled = "loss_scaling" in raw and raw["loss_scaling"] is None
    if scaling_nulled and "preset" in raw and preset(str(raw["preset"])).scales_loss:
        off_by = "precision.loss_scaling: null"
        where["compute_dtype"] = where["loss_scaling"] = doc.loc("precision.loss_scaling")

    reduce_dtype = canonical_name(pol.reduce_dtype)
    dist = doc.mapping("distributed") or {}
    if "reduce_dtype" in dist:
        try:
            reduce_dtype = canonical_name(str(dist["reduce_dtype"]))
        except ValueError as exc:
            raise ValueError(f"{doc.loc('distributed.reduce_dtype')}: {exc}") from exc

    training = doc.mapping("training") or {}
    steps = training.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(
            f"{doc.loc('training.steps')}: steps must be an integer >= 1 (planned optimizer "
            f"steps; leave it out when unknown), got {steps!r}"
        )
    peft = training.get("peft", False)
    if not isinstance(peft, bool):
        raise ValueError(f"{doc.loc('training.peft')}: peft must be true or false")

    fp8 = doc.mapping("fp8") or {}
    fp8_enabled = fp8.get("enabled", bool(fp8))
    if not isinstance(fp8_enabled, bool):
        raise ValueError(f"{doc.loc('fp8.enabled')}: enabled must be true or false")
    scaling_raw = fp8.get("scaling")
    scaling: str | None = None
    if scaling_raw is not None:
        scaling = str(scaling_raw).lower()
        if scaling not in FP8_SCALINGS:
            raise ValueError(
                f"{doc.loc('fp8.scaling')}: unknown fp8 scaling {scaling_raw!r}; valid: "
                f"{', '.join(FP8_SCALINGS)}"
            )
        if scaling == "none":
            scaling = None
    fp8_detail = "fp8.enabled with no fp8.scaling" if fp8_enabled and scaling is None else ""
    fp8_emulated = False
    if pol.fp8 is not None:  # the policy's own fp8 settings (precision.fp8 or an fp8 preset)
        recipe = pol.fp8.recipe
        if fp8 and (fp8_enabled is False or scaling not in (None, recipe)):
            raise ValueError(
                f"{doc.loc('fp8.scaling', 'fp8.enabled', 'fp8')}: the fp8 section says "
                f"{'enabled: false' if fp8_enabled is False else f'scaling {scaling!r}'}, but "
                f"{prec_loc('fp8')} trains fp8 {recipe!r}: remove the fp8 section (the "
                "policy's fp8 settings are what runs)"
            )
        fp8_enabled = True
        scaling = f"torchao float8 {recipe} (current scaling)"
        fp8_detail = f"policy {pol.name!r} fp8 {recipe!r}"
        fp8_emulated = pol.fp8.emulate is True
        where["fp8"] = prec_loc("fp8")
        if fp8_emulated:
            where["fp8_emulated"] = prec_loc("fp8")

    norms_fp32: bool | None = None
    norm_detail: tuple[str, ...] = ()
    if is_16bit_name(pol.param_dtype):
        norms_fp32, norm_detail = _norms_covered(pol)

    return TrainingFacts(
        source=doc.source,
        dialect="mixprec",
        param_dtype=canonical_name(pol.param_dtype),
        compute_dtype=canonical_name(pol.effective_compute_dtype),
        loss_scaling=pol.scales_loss,
        unscaled_acknowledged=allow_unscaled,
        loss_scaling_off_by=off_by,
        optimizer=optimizer,
        reduce_dtype=reduce_dtype,
        norms_fp32=norms_fp32,
        norm_detail=norm_detail,
        fp8_enabled=fp8_enabled,
        fp8_scaling=scaling,
        fp8_detail=fp8_detail,
        fp8_emulated=fp8_emulated,
        fp8_emulated_by="precision.fp8.emulate: true" if fp8_emulated else "",
        peft=peft,
        steps=steps,
        device=device if device is not None else _device(doc),
        where=where,
    )


def claims_mixprec(data: Mapping[str, Any]) -> bool:
    """A mixprec config has a top-level ``precision:`` mapping."""
    return isinstance(data.get("precision"), Mapping)


#: mixprec's YAML as a front end (see `mixprec.doctor.frontends.dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="mixprec",
    claims=claims_mixprec,
    read=facts_from_mixprec,
    hint="a mixprec config has a top-level 'precision:' mapping",
    keys=frozenset({"precision", "optimizer", "distributed", "training", "fp8", "device"}),
)
