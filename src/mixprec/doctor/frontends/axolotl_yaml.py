"""axolotl training configs (YAML), read into `TrainingFacts`.

An axolotl config names the model (``base_model``), the adapter, the optimizer
and the precision flags; axolotl loads the model and hands the rest to the HF
Trainer. The semantics come from axolotl-ai-cloud/axolotl:

* load dtype (``src/axolotl/utils/config/__init__.py`` ``normalize_config``):
  ``bf16``/``bfloat16`` set ``cfg.torch_dtype = "bf16"``;
  ``load_in_8bit``, ``fp16`` or ``float16`` float16; otherwise float32. The
  model is loaded in that dtype. ``bf16: auto`` becomes true where
  ``is_torch_bf16_gpu_available()``, else false with ``fp16`` turned on (unless
  set); a target device without bf16 is taken that way, an unknown one as bf16.
* ``bf16``/``fp16`` are passed to the HF Trainer: autocast through Accelerate,
  ``fp16`` with a ``GradScaler``. ``bfloat16``/``float16`` only load the weights
  in 16 bits (no autocast, no scaling).
* ``optimizer`` (``src/axolotl/utils/schemas/training.py``): an HF
  ``OptimizerNames`` value, default ``adamw_torch_fused``; the torch AdamW family
  keeps moments in the parameters' dtype and no master, bitsandbytes 8-bit ones
  int8 moments. axolotl's own names (``CustomSupportedOptimizers``,
  ``src/axolotl/utils/schemas/enums.py``, built in ``src/axolotl/core/builders/base.py``
  ``_configure_custom_optimizer``) are `AXOLOTL_OPTIMIZERS`, read with the
  ``optim_args`` they honour; ``muon``/``dion`` (the separate axolotl-contribs-mit
  package), ``sinkgd`` and ``q_galore_adamw8bit`` leave the optimizer unknown.
* ``adapter: lora``/``qlora``: only adapters train. axolotl calls PEFT's
  ``get_peft_model`` with ``autocast_adapter_dtype`` left at PEFT's default
  (True, upcasting bf16/fp16 adapter weights to fp32) unless
  ``peft_autocast_adapter_dtype`` says otherwise (``src/axolotl/loaders/adapter.py``).
* ``deepspeed: <path>``: the DeepSpeed JSON decides storage, masters and
  scaling; nothing is judged here (lint the JSON with ``--format deepspeed``).
* ``fsdp``/``fsdp_config``: FSDP1 (``fsdp_version`` 1, axolotl's default,
  ``check_fsdp_version_in_fsdp_config``) goes through Accelerate, which upcasts
  trainable 16-bit parameters to fp32 under mixed precision. FSDP2
  (``fsdp_version: 2``, top level or in ``fsdp_config``) goes through axolotl's own
  ``fsdp2_prepare_model`` (``src/axolotl/monkeypatch/accelerate/fsdp2.py``, patched
  over Accelerate's by ``loaders/patch_manager.py``), which does not upcast: the
  parameters stay in the load dtype. Either way the ``MixedPrecisionPolicy`` is
  Accelerate's ``FullyShardedDataParallelPlugin.set_mixed_precision``, whose
  ``reduce_dtype`` is the mixed-precision dtype (``fsdp_config.mixed_precision_policy``
  names another); without ``bf16``/``fp16`` gradients are reduced in the parameters'
  dtype.
* ``max_steps`` (> 0) is the run length; ``num_epochs`` gives no step count.

Nothing named in the config is imported or executed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, TrainingFacts
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.hf_trainer import (
    HF_OPTIMIZERS,
    flag,
    hf_optimizer_facts,
    optim_args,
    turned_on,
)
from mixprec.doctor.frontends.optimizers import config_bool
from mixprec.doctor.frontends.values import config_int, config_str, config_value

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "AXOLOTL_MARKERS",
    "AXOLOTL_OPTIMIZERS",
    "DEFAULT_OPTIMIZER",
    "FRONT_END",
    "claims_axolotl",
    "facts_from_axolotl",
]

#: Top-level keys that, beside ``base_model``, mark an axolotl config.
AXOLOTL_MARKERS: frozenset[str] = frozenset(
    {
        "datasets",
        "adapter",
        "micro_batch_size",
        "num_epochs",
        "sequence_len",
        "sample_packing",
        "lora_r",
        "base_model_config",
    }
)

#: axolotl's default ``optimizer`` (``src/axolotl/utils/schemas/training.py``).
DEFAULT_OPTIMIZER = "adamw_torch_fused"

_ADAPTERS = ("lora", "qlora")
_ADAM = ("exp_avg", "exp_avg_sq")

#: axolotl's own optimizers -> (state kept per parameter, None when unknown; master;
#: moments, ``"param"``: the parameters' dtype), from the class each name builds
#: (``_configure_custom_optimizer``):
#: ``optimi_adamw``: ``optimi.AdamW``, Kahan summation on by default for 16-bit
#: parameters (``kahan_sum``); ``ao_adamw_*``: torchao's ``AdamWFp8``/``AdamW8bit``/
#: ``AdamW4bit`` (``bf16_stochastic_round`` off by default; the 8/4-bit names are in
#: the enum but the builder at axolotl 067b021 has no branch for them: "Unhandled
#: optimizer"); ``adopt_adamw``: ``src/axolotl/utils/optimizers/adopt.py`` (``exp_avg``/
#: ``exp_avg_sq`` ``zeros_like(p)``); ``came_pytorch``: ``CAME`` (state built from the fp32
#: copy of a 16-bit gradient, the update added to the weight); ``flash_adam[w]``:
#: flashoptim (``master_weight_bits`` 24 and int8 moments by default); the SGD/Lion ones
#: are not judged.
AXOLOTL_OPTIMIZERS: dict[str, tuple[tuple[str, ...] | None, str, str]] = {
    "optimi_adamw": (_ADAM, "kahan", "param"),
    "ao_adamw_fp8": (_ADAM, "none", "fp8"),
    "ao_adamw_8bit": (_ADAM, "none", "int8"),
    "ao_adamw_4bit": (_ADAM, "none", "int4"),
    "adopt_adamw": (_ADAM, "none", "param"),
    "came_pytorch": (_ADAM, "none", "fp32"),
    "flash_adamw": (_ADAM, "remainder8", "int8"),
    "flash_adam": (_ADAM, "remainder8", "int8"),
    # flashoptim's SGD and Lion: their state depends on options not read here
    **{name: (None, "none", "none") for name in ("flash_sgd", "flash_sgdw", "flash_lion")},
}
_UNHANDLED = ("ao_adamw_8bit", "ao_adamw_4bit")


def _custom_group(name: str, trainable: str, args: Mapping[str, str]) -> tuple[str, str]:
    """(master, moments) of axolotl's own optimizer `name` over `trainable` parameters."""
    _, master, moments = AXOLOTL_OPTIMIZERS[name]
    half = trainable in ("bf16", "fp16")
    if name == "optimi_adamw":
        kahan = args.get("kahan_sum")
        master = "kahan" if (half if kahan is None else kahan == "true") else "none"
    elif name.startswith("ao_adamw"):
        sr = args.get("bf16_stochastic_round") == "true" and trainable == "bf16"
        master = "stochastic" if sr else "none"
    elif name.startswith("flash_adam"):
        bits = args.get("master_weight_bits", "24")
        master = {"24": "remainder8", "32": "exact"}.get(bits, "none") if half else "none"
        moments = "int8" if args.get("quantize", "true") == "true" else "param"
    return master, trainable if moments == "param" else moments


def _fsdp_version(doc: ConfigDoc) -> str:
    for key in ("fsdp_version", "fsdp_config.fsdp_version", "fsdp_config.version"):
        if doc.get(key) is not None:
            return str(doc.get(key)).strip()
    return "1"


def _bf16(doc: ConfigDoc, device: DeviceCaps | None) -> tuple[bool, bool, str]:
    """(bf16, fp16 turned on by ``bf16: auto``, note) after axolotl's ``bf16: auto``."""
    raw = doc.get("bf16")
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        if doc.get("fp16") is True:
            return False, False, "bf16 auto with fp16: true: bf16 is turned off"
        if device is not None and not device.bf16_supported:
            note = f"bf16 auto: {device.name} has no bf16, axolotl turns on fp16"
            return False, doc.get("fp16") is None, note
        note = "bf16 auto: axolotl enables bf16 where the GPU supports it; taken as bf16"
        return True, False, note
    return flag(doc, "bf16"), False, ""


def _adapter(doc: ConfigDoc) -> str:
    if doc.get("adapter") is False:
        return ""
    raw = config_str(doc, "adapter", "lora or qlora")
    if raw is None:
        return ""
    name = raw.strip().lower()
    if name and name not in _ADAPTERS:
        raise ValueError(f"{doc.loc('adapter')}: unknown adapter {raw!r}; valid: lora, qlora")
    return name


def facts_from_axolotl(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read an axolotl config into `TrainingFacts`.

    Raises:
        ValueError: for a non-boolean flag, an unknown adapter or a bad ``max_steps``.
    """
    bf16, auto_fp16, bf16_note = _bf16(doc, device)
    fp16 = flag(doc, "fp16") or auto_fp16
    bfloat16, float16 = flag(doc, "bfloat16"), flag(doc, "float16")
    if bf16 or bfloat16:
        storage = "bf16"
    elif flag(doc, "load_in_8bit") or fp16 or float16:
        storage = "fp16"
    else:
        storage = "fp32"
    storage_note = f"axolotl loads the model in {storage} (normalize_config)"
    adapter = _adapter(doc)
    peft = bool(adapter)
    ds_path = config_value(
        doc, "deepspeed", (str, Mapping, bool), "a path to a DeepSpeed JSON or a mapping"
    )
    deepspeed = turned_on(ds_path)
    fsdp = any(
        turned_on(config_value(doc, key, kinds, expected))
        for key, kinds, expected in (
            ("fsdp", (list,), "a list of FSDP options"),
            ("fsdp_config", (Mapping,), "a mapping"),
            ("fsdp_version", (int,), "1 or 2"),
        )
    )
    fsdp2 = fsdp and _fsdp_version(doc) == "2"
    amp = bf16 or fp16

    trainable, how = storage, ""
    autocast_adapters = config_bool(
        doc, "peft_autocast_adapter_dtype", doc.get("peft_autocast_adapter_dtype"), True
    )
    if peft and not autocast_adapters:
        how = "peft_autocast_adapter_dtype: false: adapters stay in the load dtype"
    elif peft:
        trainable = "fp32"
        how = "PEFT upcasts adapter weights to fp32 (autocast_adapter_dtype left at True)"
    elif fsdp2 and storage != "fp32":
        how = (
            "fsdp_version 2: axolotl's own fsdp2_prepare_model does not upcast, parameters stay "
            "in the load dtype"
        )
    elif fsdp and amp and storage != "fp32":
        trainable = "fp32"
        how = "Accelerate upcasts trainable parameters to fp32 under FSDP mixed precision"

    raw_optim = config_str(doc, "optimizer", "an optimizer name (adamw_torch_fused...)")
    optim = DEFAULT_OPTIMIZER if raw_optim is None else str(raw_optim).strip().lower()
    optimizer: OptimizerFacts | None = None
    param_dtype: str | None = trainable
    loss_scaling: bool | None = fp16
    changed_by = ""
    if fp16 and device is not None and device.device_type == "cpu":
        # the HF Trainer's Accelerator has no fp16 AMP on a CPU: no GradScaler, no autocast
        # (the weights axolotl loaded in fp16 stay fp16)
        loss_scaling = False
        changed_by = "axolotl's HF Trainer runs fp16 without autocast or a GradScaler"
    notes = [n for n in (bf16_note, storage_note, how) if n]
    if deepspeed:
        param_dtype, loss_scaling = None, None
        notes = [f"deepspeed {ds_path}: the JSON decides; lint it with --format deepspeed"]
    elif optim in AXOLOTL_OPTIMIZERS:
        master, moments = _custom_group(optim, trainable, optim_args(doc))
        opt_note = f"axolotl builds {optim} itself (_configure_custom_optimizer)"
        if optim in _UNHANDLED:
            opt_note += "; axolotl 067b021 has no builder branch for it ('Unhandled optimizer')"
        optimizer = OptimizerFacts(
            name=optim,
            state=AXOLOTL_OPTIMIZERS[optim][0],
            groups=(
                GroupFacts(
                    param_dtype=trainable,
                    master=master,
                    moments=moments,
                    label="adapters" if peft else "all parameters",
                ),
            ),
            note=opt_note,
        )
    elif optim in HF_OPTIMIZERS:
        unset = "" if raw_optim is not None else f"optimizer unset: {DEFAULT_OPTIMIZER}"
        optimizer = hf_optimizer_facts(
            optim, trainable, peft=peft, note=unset, args=optim_args(doc)
        )

    reduce_dtype: str | None = None
    reduce_note = ""
    if fsdp and not deepspeed:
        raw_policy = config_str(doc, "fsdp_config.mixed_precision_policy", "bf16, fp16 or fp32")
        policy = (raw_policy or "").strip().lower()
        named = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
        if policy in named:
            reduce_dtype = named[policy]
            reduce_note = f"fsdp_config.mixed_precision_policy {policy}: reduce_dtype {policy}"
        elif amp:
            reduce_dtype = "bf16" if bf16 else "fp16"
            reduce_note = (
                "Accelerate's FSDP plugin (set_mixed_precision) reduces in the mixed-precision "
                f"dtype ({reduce_dtype})"
            )
        else:
            reduce_dtype = trainable
            reduce_note = "no mixed precision: FSDP reduces gradients in the parameters' dtype"

    steps = config_int(doc, "max_steps")
    if steps is not None and steps <= 0:
        steps = None  # axolotl passes `max_steps or total_num_steps or -1`: epochs decide

    flags = ("bf16", "fp16", "bfloat16", "float16", "load_in_8bit")
    where = {
        "param_dtype": doc.loc("deepspeed", "adapter", *flags, "base_model"),
        "compute_dtype": doc.loc(*flags, "base_model"),
        "loss_scaling": doc.loc("fp16", "float16", "bf16"),
        "optimizer": doc.loc("optimizer", "bf16", "base_model"),
        "master": doc.loc("optimizer", "bf16", "base_model"),
        "reduce_dtype": doc.loc(
            "fsdp_config.mixed_precision_policy", "fsdp_config", "fsdp", "fsdp_version"
        ),
    }
    compute = "bf16" if bf16 else "fp16" if fp16 else storage
    return TrainingFacts(
        source=doc.source,
        dialect="axolotl",
        param_dtype=param_dtype,
        param_dtype_note="; ".join(notes),
        compute_dtype=compute,
        loss_scaling=loss_scaling,
        compute_changed_by=changed_by if loss_scaling is not None else "",
        requested_compute_dtype="fp16" if changed_by and loss_scaling is not None else None,
        optimizer=optimizer,
        reduce_dtype=reduce_dtype,
        reduce_note=reduce_note,
        peft=peft,
        steps=steps,
        device=device,
        where=where,
    )


def claims_axolotl(data: Mapping[str, Any]) -> bool:
    """An axolotl config: ``base_model`` with an axolotl key (`AXOLOTL_MARKERS`)."""
    return "base_model" in data and bool(AXOLOTL_MARKERS & set(data))


#: axolotl configs as a front end (see `dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="axolotl",
    claims=claims_axolotl,
    read=facts_from_axolotl,
    hint="an axolotl config has 'base_model:' with 'datasets:', 'micro_batch_size:'...",
)
