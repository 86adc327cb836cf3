"""LitGPT configs (``config_hub/finetune/*/*.yaml``, ``config_hub/pretrain/*.yaml``),
read into `TrainingFacts`.

A LitGPT config is the argument list of one of its scripts' ``setup()``
(``litgpt finetune_full|finetune_lora|pretrain --config FILE``): top-level
``precision``, ``devices``, ``num_nodes``, ``optimizer``, a ``train:`` section
(``litgpt/args.py`` ``TrainArgs``), and ``lora_*``/``quantize`` for LoRA. There is no
``trainer:`` section (that is the Lightning CLI, `lightning_yaml`): the script builds
a Lightning Fabric from these keys and picks the strategy in code. Semantics from
Lightning-AI/litgpt at 26857050fe3f and Lightning Fabric at 7f0c3436cd3f:

* which script: ``lora_*`` keys are ``finetune/lora.py`` (only adapters train);
  ``model_name``/``initial_checkpoint_dir``/``tokenizer_dir``/``model_config`` are
  ``pretrain.py``; otherwise ``finetune/full.py`` (the same file handed to
  ``finetune_adapter`` would train adapters only: the evidence says so).
* ``precision``: a Fabric precision (`lightning_yaml.PRECISION`, legacy spellings
  too). Unset: ``get_default_supported_precision(training=True)`` (``litgpt/utils.py``),
  ``bf16-mixed`` where bf16 is supported (or no CUDA), else ``16-mixed``. The model is
  created under ``fabric.init_module()``, so ``*-true`` makes every parameter, LoRA's
  included, 16-bit (``HalfPrecision``; ``FSDPPrecision.module_init_context``) with no
  fp32 copy; ``*-mixed`` keeps fp32 weights and autocasts, ``16-mixed`` with a scaler.
* ``devices`` x ``num_nodes`` > 1: ``full.py`` and ``pretrain.py`` use
  ``FSDPStrategy``, whose ``FSDPPrecision.mixed_precision_config`` reduces gradients
  in the 16-bit dtype for both ``*-true`` and ``*-mixed``
  (``fabric/plugins/precision/fsdp.py``); ``lora.py`` uses ``ModelParallelStrategy``
  with ``fully_shard`` and no ``MixedPrecisionPolicy``, reducing in the parameters'
  dtype. ``devices: auto`` (pretrain's default) is every visible GPU: the world size
  is unknown and the multi-device reduction is reported, saying so.
* ``optimizer``: a class name (``AdamW``: ``torch.optim.AdamW``) or a ``class_path``
  (``instantiate_torch_optimizer``); torch.optim's Adam family keeps moments in the
  parameters' dtype and no master. Other classes are not judged.
* ``quantize: bnb.*`` (LoRA): ``BitsandbytesPrecision`` with the ``*-true`` dtype and
  ``bitsandbytes.optim.PagedAdamW`` in place of the configured optimizer
  (``instantiate_bnb_optimizer``): 32-bit moments, no master, bf16 adapters.
  A ``*-mixed`` precision with ``quantize`` is refused by LitGPT (ValueError here too).
* ``train.max_steps`` (> 0) is the run length; ``epochs``/``max_tokens`` give none.

Nothing named in the config is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, TrainingFacts
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.lightning_yaml import LEGACY_PRECISION, PRECISION
from mixprec.doctor.frontends.optimizers import torch_optimizer_facts
from mixprec.floats import is_16bit_name

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "FRONT_END",
    "PRETRAIN_KEYS",
    "TRAIN_ARGS",
    "claims_litgpt",
    "facts_from_litgpt",
]

#: ``train:`` keys of LitGPT's ``TrainArgs`` (``litgpt/args.py``).
TRAIN_ARGS: frozenset[str] = frozenset(
    {
        "save_interval",
        "log_interval",
        "global_batch_size",
        "micro_batch_size",
        "lr_warmup_steps",
        "lr_warmup_fraction",
        "epochs",
        "max_tokens",
        "max_steps",
        "max_seq_length",
        "tie_embeddings",
        "max_norm",
        "min_lr",
    }
)

#: Top-level keys only ``pretrain.py``'s ``setup()`` takes.
PRETRAIN_KEYS: frozenset[str] = frozenset(
    {"model_name", "model_config", "initial_checkpoint_dir", "tokenizer_dir"}
)

_SCRIPT_KEYS = PRETRAIN_KEYS | {"checkpoint_dir"}
_PAGED_ADAMW = "bitsandbytes.optim.PagedAdamW"


def _precision(doc: ConfigDoc, device: DeviceCaps | None) -> tuple[str, str]:
    """(Fabric precision, how it was decided when unset)."""
    value = doc.get("precision")
    if value is None:
        if device is not None and device.device_type == "cuda" and not device.bf16_supported:
            return "16-mixed", f"precision unset: {device.name} has no bf16, LitGPT uses 16-mixed"
        return "bf16-mixed", "precision unset: LitGPT uses bf16-mixed where bf16 is supported"
    word = str(value).strip()
    word = LEGACY_PRECISION.get(word, word)
    if word not in PRECISION:
        valid = ", ".join([*PRECISION, *LEGACY_PRECISION])
        raise ValueError(f"{doc.loc('precision')}: unknown precision {value!r}; valid: {valid}")
    return word, ""


def _world(doc: ConfigDoc, script: str) -> tuple[int | None, str]:
    """(devices x num_nodes, None for ``auto``; how ``devices`` was decided)."""
    default = "auto" if script == "pretrain" else 1
    devices = doc.get("devices")
    devices = default if devices is None else devices
    nodes = doc.get("num_nodes")
    nodes = 1 if nodes is None else nodes
    for key, value in (("devices", devices), ("num_nodes", nodes)):
        if isinstance(value, bool) or not (isinstance(value, int) or value in ("auto", -1)):
            raise ValueError(f"{doc.loc(key)}: must be a positive integer or 'auto', got {value!r}")
    if devices in ("auto", -1):
        return None, "devices: auto is every visible GPU, so the world size is unknown"
    assert isinstance(devices, int) and isinstance(nodes, int)
    return devices * nodes, ""


def _optimizer_name(doc: ConfigDoc) -> str | None:
    value = doc.get("optimizer")
    if value is None:
        return "torch.optim.AdamW"  # setup(optimizer="AdamW")
    if isinstance(value, Mapping):
        value = value.get("class_path")
    if not isinstance(value, str) or not value.strip():
        return None
    name = value.strip()
    return name if "." in name else f"torch.optim.{name}"


def facts_from_litgpt(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read a LitGPT config into `TrainingFacts`.

    Raises:
        ValueError: for an unknown ``precision``, bad ``devices``/``num_nodes``/
            ``train.max_steps``, or ``quantize`` with a mixed precision.
    """
    lora = any(str(k).startswith("lora_") for k in doc.data)
    script = "lora" if lora else "pretrain" if PRETRAIN_KEYS & set(doc.data) else "full"
    precision, precision_note = _precision(doc, device)
    storage, compute, scaled = PRECISION[precision]
    world, world_note = _world(doc, script)
    quantize = doc.get("quantize")
    if quantize is not None and precision.endswith("-mixed"):
        raise ValueError(
            f"{doc.loc('quantize')}: LitGPT refuses quantize {quantize!r} with precision "
            f"{precision!r} (quantization and mixed precision are not supported together)"
        )

    notes = [
        *([precision_note] if precision_note else []),
        f"precision {precision}: parameters in {storage} (created under fabric.init_module)",
    ]
    if script == "full":
        notes.append("judged as finetune_full; with finetune_adapter only adapters would train")
    reduce_dtype: str | None = None
    reduce_note = ""
    if world is None or world > 1:
        size = world_note or f"devices x num_nodes = {world}"
        if script == "lora":
            reduce_dtype = storage
            reduce_note = (
                f"{size}: ModelParallelStrategy's fully_shard without a MixedPrecisionPolicy "
                "reduces in the parameters' dtype"
            )
        elif is_16bit_name(compute):
            reduce_dtype = compute
            reduce_note = (
                f"{size}: FSDPStrategy, whose FSDPPrecision reduces gradients in {compute}"
            )

    name = _optimizer_name(doc)
    label = "adapters" if lora else "all parameters"
    optimizer = None
    if quantize is not None:
        optimizer = OptimizerFacts(
            name=_PAGED_ADAMW,
            state=("exp_avg", "exp_avg_sq"),
            groups=(GroupFacts(param_dtype=storage, master="none", moments="fp32", label=label),),
            note=f"quantize {quantize}: LitGPT trains with PagedAdamW (32-bit state, no master)",
        )
    elif name is not None:
        init_args = (
            doc.get("optimizer.init_args") if isinstance(doc.get("optimizer"), Mapping) else None
        )
        options = init_args if isinstance(init_args, Mapping) else {}
        optimizer = torch_optimizer_facts(name, storage, options, label=label)

    steps = doc.get("train.max_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        raise ValueError(f"{doc.loc('train.max_steps')}: must be an integer, got {steps!r}")
    if steps is not None and steps <= 0:
        steps = None

    fp8 = precision.startswith("transformer-engine")
    prec_where = doc.loc("precision", "devices", *_SCRIPT_KEYS)
    where = {
        "param_dtype": prec_where,
        "compute_dtype": prec_where,
        "loss_scaling": prec_where,
        "optimizer": doc.loc("quantize", "precision", "optimizer"),
        "master": doc.loc("quantize", "precision", "optimizer"),
        "reduce_dtype": doc.loc("devices", "num_nodes", "precision"),
        "fp8": prec_where,
    }
    return TrainingFacts(
        source=doc.source,
        dialect="litgpt",
        param_dtype=storage,
        param_dtype_note="; ".join(notes),
        compute_dtype=compute,
        loss_scaling=scaled,
        optimizer=optimizer,
        reduce_dtype=reduce_dtype,
        reduce_note=reduce_note,
        fp8_enabled=fp8,
        fp8_scaling="Transformer Engine's recipe (delayed scaling)" if fp8 else None,
        fp8_detail=f"precision: {precision}" if fp8 else "",
        peft=lora,
        steps=steps,
        device=device,
        where=where,
    )


def claims_litgpt(data: Mapping[str, Any]) -> bool:
    """A LitGPT config: a ``train:`` mapping of ``TrainArgs`` keys with a script key
    (``checkpoint_dir``, ``model_name``...), and no Lightning ``trainer:``."""
    train = data.get("train")
    return (
        isinstance(train, Mapping)
        and bool(TRAIN_ARGS & set(train))
        and bool(_SCRIPT_KEYS & set(data))
        and "trainer" not in data
    )


#: LitGPT configs as a front end (see `dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="litgpt",
    claims=claims_litgpt,
    read=facts_from_litgpt,
    hint="a LitGPT config has 'checkpoint_dir:' or 'model_name:' with 'train:', 'precision:'",
)
