"""HF Trainer / TRL / alignment-handbook recipes (YAML or JSON), read into `TrainingFacts`.

A recipe is the flat mapping of ``TrainingArguments`` (plus TRL's ``ModelConfig``
and script arguments) that ``TrlParser``/``HfArgumentParser`` read. What is read,
and the semantics relied on (everything else is ignored):

* the load dtype of the model: ``model_init_kwargs.dtype`` (or ``torch_dtype``),
  else top-level ``dtype``/``torch_dtype``. Unset is float32 (TRL
  ``trl/trainer/model_config.py``: ``dtype`` defaults to ``"float32"``; the
  SFT/DPO trainers' ``model_init_kwargs`` too); null is taken as float32 (the
  default of ``from_pretrained`` before transformers 5, said in the evidence);
  ``auto`` loads the checkpoint's dtype, commonly bf16, and is taken as bf16.
* ``bf16``/``fp16``: autocast through Accelerate; ``fp16`` adds a
  ``GradScaler`` (dynamic loss scaling). Neither: compute in the load dtype.
* ``optim``: an ``OptimizerNames`` value of transformers' ``training_args.py``
  (unset: ``adamw_torch``/``adamw_torch_fused``). The torch AdamW family keeps
  moments in the parameters' dtype and no master; bitsandbytes 8-bit variants
  keep int8 moments, 32-bit/paged ones fp32 moments, neither a master.
* ``use_peft``/``peft_config``: only adapters train. PEFT upcasts bf16/fp16
  adapter weights to fp32 (``autocast_adapter_dtype=True``, PEFT >= 0.12); TRL
  casts the trainable adapter weights of a quantized model
  (``load_in_4bit``/``load_in_8bit``) to bf16 (``trl/trainer/sft_trainer.py``).
* ``deepspeed``: with ``bf16``/``fp16`` on, DeepSpeed's optimizer wrappers keep
  an fp32 master partition and fp32 moments (lint the DeepSpeed JSON itself with
  ``--format deepspeed`` for its reduction dtype).
* ``fsdp``/``fsdp_config``: with mixed precision on, Accelerate upcasts
  trainable low-precision parameters to fp32 before sharding
  (``accelerate/accelerator.py`` for FSDP1, ``utils/fsdp_utils.py``
  ``fsdp2_prepare_model`` for FSDP2; not for 4-bit models).
* ``max_steps`` (> 0) is the run length; ``num_train_epochs`` gives no step count.

Optimizer names are compared against the tables below; nothing is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, TrainingFacts
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.optimizers import config_bool, config_dtype, torch_state
from mixprec.doctor.frontends.values import config_int, config_str, config_value

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "DEFAULT_OPTIM",
    "FRONT_END",
    "HF_MARKERS",
    "HF_OPTIMIZERS",
    "claims_hf",
    "facts_from_hf",
    "flag",
    "hf_optimizer_facts",
    "optim_args",
    "turned_on",
]

#: Top-level keys of TrainingArguments / TRL configs that mark a recipe.
HF_MARKERS: frozenset[str] = frozenset(
    {
        "model_name_or_path",
        "model_init_kwargs",
        "per_device_train_batch_size",
        "num_train_epochs",
        "optim",
        "use_peft",
        "peft_config",
        "output_dir",
    }
)

#: transformers' default ``optim`` (``adamw_torch_fused`` on recent torch): torch AdamW.
DEFAULT_OPTIM = "adamw_torch"

_ADAM = ("exp_avg", "exp_avg_sq")

#: ``optim`` name -> (state kept per parameter, its format: ``"param"`` for the
#: parameters' dtype), from transformers' ``trainer_optimizer.py``. None keeps a master
#: of its own. ``sgd`` keeps a momentum buffer when ``optim_args`` sets a momentum
#: (`hf_optimizer_facts`); transformers' ``Adafactor`` keeps its factored second moment
#: in fp32 and writes each update into the 16-bit weight; bitsandbytes' Lion keeps its
#: momentum in fp32 (``*_32bit``) or int8.
HF_OPTIMIZERS: dict[str, tuple[tuple[str, ...], str]] = {
    **{
        name: (_ADAM, "param")
        for name in (
            "adamw_torch",
            "adamw_torch_fused",
            "adamw_hf",
            "adamw_torch_xla",
            "adamw_torch_npu_fused",
            "adamw_apex_fused",
        )
    },
    **{
        name: (_ADAM, "int8")
        for name in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "adamw_torch_8bit")
    },
    **{name: (_ADAM, "fp32") for name in ("paged_adamw_32bit", "paged_adamw", "adamw_bnb")},
    "adamw_torch_4bit": (_ADAM, "int4"),
    "sgd": ((), "param"),
    "adagrad": (("sum",), "param"),
    "rmsprop": (("square_avg",), "param"),
    "adafactor": (("exp_avg_sq_row", "exp_avg_sq_col"), "fp32"),
    **{name: (("exp_avg",), "fp32") for name in ("lion_32bit", "paged_lion_32bit")},
    **{name: (("exp_avg",), "int8") for name in ("lion_8bit", "paged_lion_8bit")},
}

#: The "judged as written" note of a 16-bit group without a master, by (deepspeed, fsdp)
#: in the recipe: the launcher or its mixed precision can still keep fp32 masters.
_AS_WRITTEN: dict[tuple[bool, bool], str] = {
    (False, False): (
        "judged as written: an Accelerate launch config with DeepSpeed (fp32 master "
        "partition) or FSDP mixed precision (fp32 upcast) would keep fp32 masters"
    ),
    (False, True): (
        "judged as written: FSDP upcasts trainable parameters to fp32 only under mixed "
        "precision; bf16/fp16 here or in the Accelerate launch config would keep fp32 masters"
    ),
    (True, False): (
        "judged as written: DeepSpeed keeps an fp32 master partition when its bf16/fp16 is "
        "enabled; lint the DeepSpeed JSON with --format deepspeed"
    ),
}

_LOAD_DTYPE_KEYS = (
    "model_init_kwargs.dtype",
    "model_init_kwargs.torch_dtype",
    "dtype",
    "torch_dtype",
)


def _load_dtype(doc: ConfigDoc) -> tuple[str, str, str]:
    """(dtype, how it was decided when not stated, key path)."""
    key = next((k for k in _LOAD_DTYPE_KEYS if doc.has(k)), "")
    if not key:
        return "fp32", "dtype unset: TRL loads the model in float32 (its default)", ""
    raw = doc.get(key)
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        note = (
            f"{key} auto: transformers loads the checkpoint's dtype, commonly bf16; taken as bf16"
        )
        return "bf16", note, key
    dt = config_dtype(doc, key, raw)
    if dt is None:
        note = (
            f"{key} null: from_pretrained's default, float32 before transformers 5 "
            "(transformers 5 defaults to 'auto')"
        )
        return "fp32", note, key
    return dt, "", key


def flag(doc: ConfigDoc, key: str) -> bool:
    """A boolean key of the recipe (False when absent; a non-boolean is refused)."""
    return config_bool(doc, key, doc.get(key), False)


def turned_on(value: Any) -> bool:
    """Whether a ``deepspeed``/``fsdp`` value turns the feature on (the Trainer's
    reading, which axolotl shares)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "none")
    if isinstance(value, Mapping | list):
        return bool(value)
    return value is not None


def hf_optimizer_facts(
    name: str, trainable: str, *, peft: bool, note: str, args: Mapping[str, str] | None = None
) -> OptimizerFacts:
    """What an `HF_OPTIMIZERS` optimizer keeps for parameters stored in `trainable` (no
    master; state in the parameters' dtype or the table's format), with `args` its
    ``optim_args`` (``momentum`` gives ``sgd`` a momentum buffer); axolotl shares it."""
    state, moments = HF_OPTIMIZERS[name]
    if name == "sgd":
        state = torch_state("SGD", args or {})
    group = GroupFacts(
        param_dtype=trainable,
        master="none",
        moments=("none" if not state else trainable if moments == "param" else moments),
        label="adapters" if peft else "all parameters",
    )
    return OptimizerFacts(name=name, state=state, groups=(group,), note=note)


def optim_args(doc: ConfigDoc) -> dict[str, str]:
    """``optim_args`` as transformers parses them (``"k1=v1,k2=v2"``; axolotl also
    takes a mapping), values lowercased."""
    raw = doc.get("optim_args")
    if isinstance(raw, Mapping):
        return {str(k): str(v).strip().lower() for k, v in raw.items()}
    if isinstance(raw, str):
        pairs = (item.split("=", 1) for item in raw.replace(" ", "").split(",") if "=" in item)
        return {k: v.lower() for k, v in pairs}
    return {}


def facts_from_hf(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read an HF Trainer / TRL recipe into `TrainingFacts`.

    Raises:
        ValueError: for values that are not valid (an unknown dtype spelling...).
    """
    doc.mapping("model_init_kwargs")  # ValueError when present but not a mapping
    storage, storage_note, dtype_key = _load_dtype(doc)
    bf16, fp16 = flag(doc, "bf16"), flag(doc, "fp16")
    if bf16 and fp16:  # transformers' TrainingArguments._validate_args (from __post_init__)
        raise ValueError(
            f"{doc.loc('fp16')}: bf16: true and fp16: true together: TrainingArguments "
            "refuses them ('At most one of fp16 and bf16 can be True, but not both'); keep one"
        )
    quantized = flag(doc, "load_in_4bit") or flag(doc, "load_in_8bit")
    peft_config = doc.mapping("peft_config")
    peft = flag(doc, "use_peft") or bool(peft_config)
    deepspeed = turned_on(
        config_value(
            doc, "deepspeed", (str, Mapping, bool), "a path to a DeepSpeed JSON or a mapping"
        )
    )
    fsdp = turned_on(
        config_value(
            doc, "fsdp", (str, list, bool), "FSDP options ('full_shard auto_wrap' or a list)"
        )
    ) or turned_on(config_value(doc, "fsdp_config", (str, Mapping), "a path or a mapping"))
    amp = bf16 or fp16

    trainable, how = storage, ""
    if peft and quantized:
        trainable = "bf16"
        how = "TRL casts the trainable adapter weights of a quantized model to bf16"
    elif peft:
        trainable = "fp32"
        how = "PEFT upcasts adapter weights to fp32 (autocast_adapter_dtype=True)"
    elif fsdp and amp and storage != "fp32":
        trainable = "fp32"
        how = "Accelerate upcasts trainable parameters to fp32 under FSDP mixed precision"

    raw_optim = config_str(doc, "optim", "an optimizer name (OptimizerNames: adamw_torch...)")
    optim = DEFAULT_OPTIM if raw_optim is None else str(raw_optim).strip().lower()
    optimizer: OptimizerFacts | None = None
    if deepspeed and amp:
        optimizer = OptimizerFacts(
            name=f"{optim} under DeepSpeed",
            state=HF_OPTIMIZERS[optim][0] if optim in HF_OPTIMIZERS else None,
            groups=(GroupFacts(param_dtype=trainable, master="fp32", moments="fp32"),),
            note="DeepSpeed's bf16/fp16 optimizers keep an fp32 master partition",
        )
    elif optim in HF_OPTIMIZERS:
        notes = [how] if how else []
        if raw_optim is None:
            notes.append(f"optim unset: the HF Trainer's default is {DEFAULT_OPTIM}")
        if trainable != "fp32":  # every 16-bit group: say what a launcher may change
            notes.append(_AS_WRITTEN[(deepspeed, fsdp and not deepspeed)])
        optimizer = hf_optimizer_facts(
            optim, trainable, peft=peft, note="; ".join(notes), args=optim_args(doc)
        )

    compute = "bf16" if bf16 else "fp16" if fp16 else storage
    changed_by = ""
    if fp16 and device is not None and device.device_type == "cpu":
        # transformers builds its Accelerator with fp16, which on a CPU turns native AMP
        # off: no autocast and no GradScaler (measured: transformers 5.24, accelerate 1.15)
        compute, changed_by = (
            storage,
            (
                "the HF Trainer runs fp16: true without autocast (Accelerate has no fp16 AMP on "
                "a CPU)"
            ),
        )
    steps = config_int(doc, "max_steps")
    if steps is not None and steps <= 0:
        steps = None  # -1 (the default) or 0: num_train_epochs decides (Trainer: max_steps > 0)

    model_where = doc.loc(dtype_key, "model_name_or_path") if dtype_key else doc.source
    where = {
        "param_dtype": model_where,
        "compute_dtype": doc.loc("bf16", "fp16", dtype_key or "bf16"),
        "loss_scaling": doc.loc("fp16", "bf16"),
        "optimizer": doc.loc("optim", dtype_key or "optim"),
        "master": doc.loc("optim", "deepspeed"),
    }
    return TrainingFacts(
        source=doc.source,
        dialect="hf",
        param_dtype=trainable,
        param_dtype_note="; ".join(n for n in (storage_note, how) if n),
        compute_dtype=compute,
        loss_scaling=fp16 and not changed_by,
        compute_changed_by=changed_by,
        requested_compute_dtype="fp16" if changed_by else None,
        optimizer=optimizer,
        peft=peft,
        steps=steps,
        device=device,
        where=where,
    )


def claims_hf(data: Mapping[str, Any]) -> bool:
    """An HF Trainer / TRL recipe: a TrainingArguments/ModelConfig key (`HF_MARKERS`),
    or a boolean ``bf16``/``fp16`` (DeepSpeed's are mappings)."""
    return bool(HF_MARKERS & set(data)) or any(
        isinstance(data.get(k), bool) for k in ("bf16", "fp16")
    )


#: HF Trainer / TRL as a front end (see `mixprec.doctor.frontends.dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="hf",
    claims=claims_hf,
    read=facts_from_hf,
    hint="an HF Trainer/TRL recipe has 'model_name_or_path:', 'bf16:', 'optim:'...",
    keys=HF_MARKERS
    | {"dtype", "torch_dtype", "bf16", "fp16", "load_in_4bit", "load_in_8bit", "max_steps"}
    | {"deepspeed", "fsdp", "fsdp_config"},
)
