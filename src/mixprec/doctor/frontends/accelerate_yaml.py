"""Accelerate launch configs (``accelerate config`` YAML), read into `TrainingFacts`.

A launch config says how a script is run, not which model or optimizer it
builds, so the load dtype and the optimizer are mostly unknown and the rules that
need them stay silent. The semantics come from huggingface/accelerate:

* ``mixed_precision`` (``no``/``fp16``/``bf16``/``fp8``;
  ``utils/dataclasses.py`` ``PrecisionType``): autocast over the weights the
  script loads; ``fp16`` adds a ``GradScaler`` (a ``ShardedGradScaler`` under
  FSDP1, ``accelerator.py``). ``fp8`` keeps bf16 autocast for everything else and
  runs fp8 matmuls through a scaled recipe (``fp8_config.backend``: TE, MS-AMP or
  torchao; the TE recipe's ``fp8_format``, ``amax_history_len``,
  ``amax_compute_algo``, ``margin`` are read into `TrainingFacts.fp8_scaling`,
  `fp8_recipes`).
* ``distributed_type: FSDP``: with mixed precision on, trainable parameters
  loaded in 16 bits are upcast to fp32 before sharding (``accelerator.py`` for
  FSDP1, ``utils/fsdp_utils.py`` ``fsdp2_prepare_model``), and the policy
  ``FullyShardedDataParallelPlugin.set_mixed_precision`` builds reduces
  gradients in the mixed-precision dtype (``reduce_dtype=dtype``; bf16 for fp8).
* ``distributed_type: DEEPSPEED``: ``DeepSpeedPlugin.set_mixed_precision``
  writes ``fp16: {enabled: true, auto_cast: true}`` (dynamic loss scale) or
  ``bf16: {enabled: true}`` (also for fp8) into the DeepSpeed config it builds
  from ``deepspeed_config``; the engine casts the model to that dtype, keeps an
  fp32 master partition and fp32 moments, and, with no
  ``communication_data_type`` (set to fp32 only on ROCm), reduces gradients in
  the 16-bit dtype. With ``deepspeed_config.deepspeed_config_file`` the JSON file
  decides: lint it with ``--format deepspeed``.
* ``distributed_type: XLA`` (``TPU`` in old configs) with ``bf16``: Accelerate
  sets ``XLA_USE_BF16=1`` or, with ``downcast_bf16``, ``XLA_DOWNCAST_BF16=1``
  (``state.py``, ``utils/launch.py``); both make every ``torch.float`` tensor on
  the TPU bf16 (``docs/source/concept_guides/training_tpu.md``), the weights and
  the optimizer's state included, with no fp32 master. ``downcast_bf16`` does
  nothing elsewhere.

YAML 1.1 reads unquoted ``no``/``NO`` as false: ``mixed_precision: no`` and
``distributed_type: NO`` are taken as ``"no"``/``"NO"``. Nothing is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, TrainingFacts
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.fp8_recipes import (
    AMAX_ALGOS,
    TE_FORMATS,
    check_choice,
    describe_te_delayed,
)
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.values import config_int, config_str, config_value

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "ACCELERATE_MARKERS",
    "DEEPSPEED_FILE_CONFLICTS",
    "FP8_UNREAD_SPELLINGS",
    "FRONT_END",
    "MIXED_PRECISION",
    "claims_accelerate",
    "facts_from_accelerate",
]

#: Top-level keys that only an Accelerate launch config has.
ACCELERATE_MARKERS: frozenset[str] = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "downcast_bf16",
        "main_training_function",
        "deepspeed_config",
        "fp8_config",
        "num_machines",
        "machine_rank",
    }
)

#: ``mixed_precision`` value -> the autocast dtype (fp8 autocasts the rest to bf16).
MIXED_PRECISION: dict[str, str | None] = {
    "no": None,
    "fp16": "fp16",
    "bf16": "bf16",
    "fp8": "bf16",
}


def _word(doc: ConfigDoc, key: str, *, false: str, expected: str) -> str:
    """A config word; YAML's false (an unquoted ``no``) and null are `false`."""
    value = config_value(doc, key, (str, bool), expected)
    if value is None or value is False:
        return false
    if value is True:
        raise ValueError(f"{doc.loc(key)}: must be {expected}, got a boolean True")
    return str(value).strip()


def _mixed_precision(doc: ConfigDoc) -> str:
    mp = _word(doc, "mixed_precision", false="no", expected="no, fp16, bf16 or fp8").lower()
    if mp not in MIXED_PRECISION:
        raise ValueError(
            f"{doc.loc('mixed_precision')}: unknown mixed_precision {mp!r}; "
            f"valid: {', '.join(MIXED_PRECISION)}"
        )
    return mp


def _yes(doc: ConfigDoc, key: str) -> bool:
    """``downcast_bf16``-style flags: true/false or Accelerate's ``'yes'``/``'no'``."""
    value = doc.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    word = str(value).strip().lower()
    if word in ("yes", "true", "no", "false", "none", ""):
        return word in ("yes", "true")
    raise ValueError(f"{doc.loc(key)}: must be 'yes' or 'no', got {value!r}")


#: Launch-config settings Accelerate refuses beside ``deepspeed_config_file``
#: (``DeepSpeedPlugin._deepspeed_config_checks`` in ``utils/dataclasses.py``): the
#: JSON file must say them. ``mixed_precision`` counts when the config sets it
#: (``commands/launch.py`` ``launch_command``).
DEEPSPEED_FILE_CONFLICTS: tuple[str, ...] = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
)


def _refused_with_deepspeed_file(doc: ConfigDoc) -> None:
    """Raise when the config sets what Accelerate refuses beside a DeepSpeed JSON file."""
    conflicts = [
        f"deepspeed_config.{k}"
        for k in DEEPSPEED_FILE_CONFLICTS
        if doc.has(f"deepspeed_config.{k}")
    ]
    if doc.get("mixed_precision") is not None:
        conflicts.insert(0, "mixed_precision")
    if conflicts:
        raise ValueError(
            f"{doc.loc(conflicts[0])}: {', '.join(conflicts)} beside "
            "deepspeed_config.deepspeed_config_file: accelerate launch refuses the config "
            "('When using `deepspeed_config_file`, the following accelerate config variables "
            "will be ignored', DeepSpeedPlugin); set them in the DeepSpeed JSON and remove them "
            "here"
        )


#: Spellings ``accelerate config`` writes that ``accelerate launch`` does not read: the
#: launcher exports ``fp8_config.X`` as ``ACCELERATE_FP8_X`` and ``TERecipeKwargs`` reads
#: ``ACCELERATE_FP8_AMAX_HISTORY_LEN``/``_AMAX_COMPUTE_ALGO`` (``utils/dataclasses.py``),
#: so these keep the launcher's defaults (1024, ``most_recent``).
FP8_UNREAD_SPELLINGS: dict[str, str] = {
    "amax_history_length": "amax_history_len",
    "amax_compute_algorithm": "amax_compute_algo",
}


def _fp8_scaling(doc: ConfigDoc) -> str:
    """The fp8 recipe ``fp8_config`` selects: every backend scales (TE delayed scaling,
    or MXFP8 blocks with ``use_mxfp8_block_scaling``; MS-AMP; torchao's tensorwise
    current scaling, ``AORecipeKwargs``'s default ``Float8LinearConfig``)."""
    doc.mapping("fp8_config")  # ValueError when present but not a mapping
    backend_raw = config_str(doc, "fp8_config.backend", "a backend name (TE, MSAMP, AO)")
    if backend_raw is None:
        return (
            "Accelerate's default fp8 recipe (torchao, else Transformer Engine, else MS-AMP: "
            "all scaled)"
        )
    backend = check_choice(doc, "fp8_config.backend", backend_raw, ("TE", "MSAMP", "AO"))
    if backend == "AO":
        return "torchao float8 tensorwise current scaling (AORecipeKwargs, fp8_config.backend AO)"
    if backend == "MSAMP":
        level = config_str(doc, "fp8_config.opt_level") or config_str(
            doc, "fp8_config.optimization_level"
        )
        return f"MS-AMP{f' {level}' if level else ''} (fp8_config.backend MSAMP)"
    fmt_raw = config_str(doc, "fp8_config.fp8_format", "HYBRID, E4M3 or E5M2")
    fmt = (
        "HYBRID"
        if fmt_raw is None
        else check_choice(doc, "fp8_config.fp8_format", fmt_raw, TE_FORMATS)
    )
    if doc.get("fp8_config.use_mxfp8_block_scaling") is True:
        return f"Transformer Engine MXFP8BlockScaling ({fmt}; fp8_config.use_mxfp8_block_scaling)"
    history = config_int(doc, "fp8_config.amax_history_len")
    algo_raw = config_str(doc, "fp8_config.amax_compute_algo", "max or most_recent")
    algo = (
        None
        if algo_raw is None
        else check_choice(doc, "fp8_config.amax_compute_algo", algo_raw, AMAX_ALGOS)
    )
    margin = config_int(doc, "fp8_config.margin")
    text = describe_te_delayed(
        fp8_format=fmt,
        history=1024 if history is None else history,
        algo="most_recent" if algo is None else algo,
        margin=0 if margin is None else margin,
    )
    unread = [
        f"fp8_config.{k} is not read by accelerate launch (it reads {v}; the default applies)"
        for k, v in FP8_UNREAD_SPELLINGS.items()
        if doc.has(f"fp8_config.{k}")
    ]
    return text + (f"; {'; '.join(unread)}" if unread else "")


def facts_from_accelerate(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read an Accelerate launch config into `TrainingFacts`.

    Raises:
        ValueError: for an unknown ``mixed_precision`` or a bad ``downcast_bf16``.
    """
    mp = _mixed_precision(doc)
    dist = _word(
        doc, "distributed_type", false="NO", expected="a distributed type (NO, FSDP, DEEPSPEED...)"
    ).upper()
    amp_dtype = MIXED_PRECISION[mp]
    downcast = _yes(doc, "downcast_bf16")
    doc.mapping("deepspeed_config")  # ValueError when present but not a mapping
    ds_file = config_str(doc, "deepspeed_config.deepspeed_config_file", "a path")

    param_dtype: str | None = None
    param_note = ""
    optimizer: OptimizerFacts | None = None
    reduce_dtype: str | None = None
    reduce_note = ""
    loss_scaling: bool | None = mp == "fp16"
    compute = amp_dtype

    if dist == "DEEPSPEED" and ds_file:
        # the JSON file decides storage, scaling and reduction
        _refused_with_deepspeed_file(doc)
        param_dtype, compute, loss_scaling = None, None, None
        param_note = f"deepspeed_config_file {ds_file}: lint it with --format deepspeed"
    elif dist == "DEEPSPEED" and amp_dtype is not None:
        param_dtype = amp_dtype
        param_note = f"DeepSpeed casts the model to {amp_dtype}"
        optimizer = OptimizerFacts(
            name="the script's optimizer under DeepSpeed",
            state=("exp_avg", "exp_avg_sq"),
            groups=(GroupFacts(param_dtype=amp_dtype, master="fp32", moments="fp32"),),
            note="DeepSpeed's bf16/fp16 optimizers keep an fp32 master partition and fp32 moments",
        )
        reduce_dtype = amp_dtype
        reduce_note = (
            "Accelerate's DeepSpeed config sets no communication_data_type (except on ROCm): "
            f"DeepSpeed reduces gradients in {amp_dtype}"
        )
    elif dist == "FSDP" and amp_dtype is not None:
        param_dtype = "fp32"
        param_note = "Accelerate upcasts trainable parameters to fp32 under FSDP mixed precision"
        reduce_dtype = amp_dtype
        reduce_note = (
            "FullyShardedDataParallelPlugin.set_mixed_precision: reduce_dtype is the "
            f"mixed-precision dtype ({amp_dtype})"
        )
    elif dist in ("XLA", "TPU") and mp == "bf16":
        env = "XLA_DOWNCAST_BF16=1" if downcast else "XLA_USE_BF16=1"
        param_dtype = "bf16"
        param_note = f"{env}: every torch.float tensor on the TPU is bf16"
        optimizer = OptimizerFacts(
            name="the script's optimizer",
            state=("exp_avg", "exp_avg_sq"),
            groups=(GroupFacts(param_dtype="bf16", master="none", moments="bf16"),),
            note=(
                f"{env} makes the weights and any optimizer state bf16 on the TPU; the launch "
                "config names no optimizer, an Adam-family one is assumed"
            ),
        )
        reduce_dtype = "bf16"
        reduce_note = f"{env}: gradients are bf16"

    changed_by = ""
    on_cpu = device is not None and device.device_type == "cpu"
    if mp == "fp16" and dist in ("NO", "MULTI_CPU") and on_cpu:
        # Accelerator(mixed_precision="fp16") on a CPU sets native_amp False: no autocast,
        # no GradScaler (measured: accelerate 1.15)
        compute, loss_scaling, changed_by = (
            param_dtype,
            False,
            ("Accelerate runs mixed_precision: fp16 without autocast (no fp16 AMP on a CPU)"),
        )
    mp_where = doc.loc("mixed_precision", "distributed_type")
    where = {
        "param_dtype": doc.loc("deepspeed_config.deepspeed_config_file", "distributed_type")
        if dist in ("DEEPSPEED", "FSDP")
        else doc.loc("downcast_bf16", "distributed_type", "mixed_precision"),
        "compute_dtype": mp_where,
        "loss_scaling": mp_where,
        "optimizer": doc.loc("distributed_type", "mixed_precision"),
        "master": doc.loc("distributed_type", "mixed_precision"),
        "reduce_dtype": doc.loc("distributed_type", "mixed_precision"),
        "fp8": mp_where,
    }
    fp8 = mp == "fp8"
    return TrainingFacts(
        source=doc.source,
        dialect="accelerate",
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
        fp8_scaling=_fp8_scaling(doc) if fp8 else None,
        fp8_detail="mixed_precision: fp8 (fp8 matmuls, bf16 autocast elsewhere)" if fp8 else "",
        device=device,
        where=where,
    )


def claims_accelerate(data: Mapping[str, Any]) -> bool:
    """An Accelerate launch config: an Accelerate-only top-level key (`ACCELERATE_MARKERS`)."""
    return bool(ACCELERATE_MARKERS & set(data))


#: Accelerate launch configs as a front end (see `dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="accelerate",
    claims=claims_accelerate,
    read=facts_from_accelerate,
    hint="an Accelerate launch config has 'distributed_type:', 'compute_environment:'...",
    keys=ACCELERATE_MARKERS | {"mixed_precision"},
)
