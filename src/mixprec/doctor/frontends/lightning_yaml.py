"""Lightning CLI configs (``LightningCLI`` YAML: ``trainer:``, ``model:``,
``data:``, ``optimizer:``), read into `TrainingFacts`.

Semantics from Lightning-AI/pytorch-lightning at commit 7f0c3436cd3f:

* ``trainer.precision`` (``src/lightning/fabric/plugins/precision/precision.py``
  ``_PRECISION_INPUT``): ``32-true``/``64-true`` full precision;
  ``16-mixed``/``bf16-mixed`` AMP over fp32 weights (``MixedPrecision``,
  ``plugins/precision/amp.py``; ``16-mixed`` with a ``GradScaler``);
  ``16-true``/``bf16-true`` convert the module to that dtype with no scaler and no
  fp32 copy (``HalfPrecision``, ``plugins/precision/half.py`` ``convert_module``);
  ``transformer-engine`` (``-float16``) keeps bf16 (fp16) weights, no scaler,
  and runs fp8 matmuls under TE's ``DelayedScaling`` recipe
  (``plugins/precision/transformer_engine.py``). The legacy values
  ``16``/``bf16`` (and ints ``16``/``32``/``64``) mean
  ``16-mixed``/``bf16-mixed``/``32-true``/``64-true``
  (``_PRECISION_INPUT_STR_ALIAS_CONVERSION``, ``fabric/connector.py``
  ``_convert_precision_to_unified_args``).
* ``trainer.strategy: fsdp``: ``FSDPPrecision.mixed_precision_config``
  (``src/lightning/pytorch/plugins/precision/fsdp.py``) reduces gradients in the
  16-bit dtype (``reduce_dtype = param_dtype``); storage under ``*-true`` with FSDP
  is left unknown. ``deepspeed*`` strategies: DeepSpeed decides, nothing judged.
  ``ddp*`` strategies reduce gradients in the parameters' dtype.
* ``optimizer``: a ``class_path`` (or a bare class name, as ``--optimizer AdamW``
  writes it) of a torch.optim Adam-family class keeps its moments in the
  parameters' dtype, no master. Optimizers built in ``configure_optimizers``
  are unknown.

Nothing named in the config is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import TrainingFacts
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.fp8_recipes import megatron_fp8
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.optimizers import torch_optimizer_facts
from mixprec.doctor.frontends.values import config_int, config_str, config_value

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "FRONT_END",
    "LEGACY_PRECISION",
    "LIGHTNING_TRAINER_KEYS",
    "PRECISION",
    "claims_lightning",
    "facts_from_lightning",
]

#: ``trainer:`` keys of Lightning's ``Trainer``.
LIGHTNING_TRAINER_KEYS: frozenset[str] = frozenset(
    {
        "accelerator",
        "devices",
        "precision",
        "max_epochs",
        "max_steps",
        "strategy",
        "num_nodes",
        "accumulate_grad_batches",
        "gradient_clip_val",
        "check_val_every_n_epoch",
        "log_every_n_steps",
        "enable_checkpointing",
    }
)

#: ``trainer.precision`` -> (weight storage, compute dtype, loss scaled).
PRECISION: dict[str, tuple[str, str, bool]] = {
    "32-true": ("fp32", "fp32", False),
    "64-true": ("fp64", "fp64", False),
    "16-mixed": ("fp32", "fp16", True),
    "bf16-mixed": ("fp32", "bf16", False),
    "16-true": ("fp16", "fp16", False),
    "bf16-true": ("bf16", "bf16", False),
    "transformer-engine": ("bf16", "bf16", False),
    "transformer-engine-float16": ("fp16", "fp16", False),
}

#: Lightning's historical spellings (``_PRECISION_INPUT_STR_ALIAS_CONVERSION``).
LEGACY_PRECISION: dict[str, str] = {
    "64": "64-true",
    "32": "32-true",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
}


def _precision(doc: ConfigDoc) -> str:
    doc.mapping("trainer")  # ValueError when present but not a mapping
    value = config_value(doc, "trainer.precision", (str, int), "a precision (bf16-mixed...)")
    if value is None:
        return "32-true"
    word = str(value).strip()
    word = LEGACY_PRECISION.get(word, word)
    if word not in PRECISION:
        valid = ", ".join([*PRECISION, *LEGACY_PRECISION])
        raise ValueError(
            f"{doc.loc('trainer.precision')}: unknown precision {value!r}; valid: {valid}"
        )
    return word


def _class_path(doc: ConfigDoc, path: str, expected: str) -> str | None:
    """A LightningCLI class argument: a name, or a mapping with a ``class_path`` name."""
    value = config_value(doc, path, (str, Mapping), expected)
    if isinstance(value, Mapping):
        return config_str(doc, f"{path}.class_path", "a dotted class name")
    name: str | None = value
    return name


def _strategy(doc: ConfigDoc) -> str:
    value = _class_path(doc, "trainer.strategy", "a strategy name or a class_path mapping")
    name = (value or "auto").strip().lower()
    return name.rsplit(".", 1)[-1]


def _optimizer_name(doc: ConfigDoc) -> str | None:
    value = _class_path(doc, "optimizer", "an optimizer class name or a class_path mapping")
    if value is None or not value.strip():
        return None
    name = value.strip()
    return name if "." in name else f"torch.optim.{name}"


def facts_from_lightning(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read a Lightning CLI config into `TrainingFacts`.

    Raises:
        ValueError: for an unknown ``trainer.precision``.
    """
    precision = _precision(doc)
    strategy = _strategy(doc)
    storage, compute, scaled = PRECISION[precision]
    param_dtype: str | None = storage
    param_note = f"trainer.precision: {precision}"
    reduce_dtype: str | None = None
    reduce_note = ""
    loss_scaling: bool | None = scaled
    changed_by = ""
    if precision == "16-mixed" and device is not None and device.device_type == "cpu":
        # lightning.fabric.connector: "AMP with fp16 is not supported on CPU. Using
        # `precision='bf16-mixed'` instead." (a warning; measured: lightning 2.6)
        compute, loss_scaling = "bf16", False
        changed_by = "Lightning replaces 16-mixed with bf16-mixed (with a warning)"
    if strategy.startswith("deepspeed"):
        param_dtype, loss_scaling = None, None
        param_note = "a DeepSpeed strategy decides storage and scaling"
    elif strategy.startswith("fsdp"):
        if precision.endswith("-true") and compute != "fp32":
            param_dtype = None
            param_note = f"FSDP with {precision}: storage left unknown"
        if compute in ("fp16", "bf16"):
            reduce_dtype = compute
            reduce_note = (
                "FSDPPrecision.mixed_precision_config: reduce_dtype is the precision's "
                f"dtype ({compute})"
            )
    elif strategy.startswith("ddp"):
        reduce_dtype = storage
        reduce_note = f"DDP reduces gradients in the parameters' dtype ({storage})"

    name = _optimizer_name(doc)
    optimizer = None
    if name is not None and param_dtype is not None:
        has_args = isinstance(doc.get("optimizer"), Mapping)
        init_args = doc.mapping("optimizer.init_args") if has_args else None
        optimizer = torch_optimizer_facts(name, param_dtype, init_args or {})

    fp8 = precision.startswith("transformer-engine")
    fp8_scaling = "Transformer Engine's recipe (delayed scaling)" if fp8 else None
    fp8_detail = f"trainer.precision: {precision}" if fp8 else ""
    # NeMo 1.x Megatron configs (a Lightning trainer): TE fp8 set under model.
    megatron = megatron_fp8(doc, "model.") if doc.has("model.fp8") else None
    if megatron is not None:
        fp8, (fp8_scaling, fp8_detail) = True, megatron
    prec_where = doc.loc("trainer.precision", "trainer")
    where = {
        "param_dtype": prec_where,
        "compute_dtype": prec_where,
        "loss_scaling": prec_where,
        "optimizer": doc.loc("trainer.precision", "optimizer"),
        "master": doc.loc("trainer.precision", "optimizer"),
        "reduce_dtype": doc.loc("trainer.strategy", "trainer.precision"),
        "fp8": doc.loc("model.fp8") if megatron is not None else prec_where,
    }
    steps = config_int(doc, "trainer.max_steps")
    if steps is not None and steps < -1:  # _TrainingEpochLoop raises MisconfigurationException
        raise ValueError(
            f"{doc.loc('trainer.max_steps')}: must be -1 (no limit) or >= 0, got {steps}: "
            "Lightning refuses it"
        )
    if steps == 0:  # _is_max_limit_reached(0, 0): fit stops before the first step
        raise ValueError(
            f"{doc.loc('trainer.max_steps')}: 0 stops Trainer.fit before the first step; give "
            "the planned step count, or -1 to let max_epochs decide"
        )
    if steps == -1:
        steps = None  # Lightning's default: bounded by max_epochs instead
    return TrainingFacts(
        source=doc.source,
        dialect="lightning",
        param_dtype=param_dtype,
        param_dtype_note=param_note,
        compute_dtype=compute,
        loss_scaling=loss_scaling,
        compute_changed_by=changed_by,
        requested_compute_dtype="fp16" if changed_by else None,
        optimizer=optimizer,
        reduce_dtype=reduce_dtype,
        reduce_note=reduce_note,
        fp8_enabled=fp8,
        fp8_scaling=fp8_scaling,
        fp8_detail=fp8_detail,
        steps=steps,
        device=device,
        where=where,
    )


def claims_lightning(data: Mapping[str, Any]) -> bool:
    """A Lightning CLI config: a ``trainer:`` mapping with a Lightning ``Trainer`` key."""
    trainer = data.get("trainer")
    return isinstance(trainer, Mapping) and bool(LIGHTNING_TRAINER_KEYS & set(trainer))


#: Lightning CLI configs as a front end (see `dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="lightning",
    claims=claims_lightning,
    read=facts_from_lightning,
    hint="a Lightning CLI config has 'trainer:' with 'precision:', 'devices:'...",
)
