"""torchtitan TOML job configs (``train_configs/*.toml``), read into `TrainingFacts`.

Semantics from pytorch/torchtitan at commit 238fa9953e4a (the last one with TOML
job configs; later ones moved to Python dataclasses):

* ``[training] dtype`` (``bfloat16``/``float32``, default ``float32``;
  ``torchtitan/config/job_config.py`` ``Training``): the default dtype the model is
  built in (``train.py`` ``set_default_dtype``). ``bfloat16`` is full bf16
  training: weights, gradients and the optimizer's state in bf16, no fp32 copy.
* ``[training] mixed_precision_param`` (default ``bfloat16``) and
  ``mixed_precision_reduce`` (default ``float32``): with FSDP or context
  parallelism (``data_parallel_shard_degree`` other than 1, or
  ``context_parallel_degree`` > 1; ``distributed/parallel_dims.py``
  ``fsdp_enabled``) they become FSDP2's ``MixedPrecisionPolicy(param_dtype,
  reduce_dtype)`` over the sharded parameters (``models/llama3/infra/
  parallelize.py`` ``apply_fsdp``). Without FSDP, DDP or one device autocasts to
  ``mixed_precision_param`` (``distributed/utils.py`` ``maybe_enable_amp``); with
  tensor or pipeline parallelism and no FSDP mixed precision is off. torchtitan's
  typed config accepts only ``float32`` for ``mixed_precision_reduce``; another
  value (a fork, a hand-edited config) is judged as it asks.
* ``[optimizer] name``: ``Adam`` or ``AdamW`` (default), torch.optim classes
  (``components/optimizer.py`` ``build_optimizers``): moments in the parameters'
  dtype, no master.
* ``[model] converters`` naming ``float8`` (``quantize.linear.float8``,
  ``quantize.grouped_mm.float8``) or ``mx`` converters: fp8 training through
  torchao, always scaled: tensorwise by default or the
  ``[quantize.linear.float8] recipe_name`` (``components/quantization/float8.py``),
  MX block scaling (``mx.py``). A ``[quantize...]`` section alone does nothing.

bf16 needs no loss scaling and torchtitan has none (``loss_scaling`` is False).
Nothing is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, TrainingFacts
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.fp8_recipes import TORCHAO_RECIPES, check_choice
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.values import config_int, config_str, config_value

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "ADAM_OPTIMIZERS",
    "DTYPES",
    "FRONT_END",
    "TORCHTITAN_SECTIONS",
    "claims_torchtitan",
    "facts_from_torchtitan",
]

#: Top-level tables of a torchtitan job config.
TORCHTITAN_SECTIONS: frozenset[str] = frozenset(
    {"job", "model", "training", "parallelism", "optimizer", "lr_scheduler", "checkpoint"}
)

#: torchtitan dtype names (``TORCH_DTYPE_MAP``) -> dtypes.
DTYPES: dict[str, str] = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
}

#: ``[optimizer] name`` values that are torch.optim Adam-family classes.
ADAM_OPTIMIZERS: frozenset[str] = frozenset({"Adam", "AdamW"})

_MOMENTS = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _dtype(doc: ConfigDoc, path: str, default: str) -> str:
    value = doc.get(path, default)
    if not isinstance(value, str) or value not in DTYPES:
        raise ValueError(f"{doc.loc(path)}: unknown dtype {value!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[value]


def _degree(doc: ConfigDoc, path: str, default: int) -> int:
    value = doc.get(path, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{doc.loc(path)}: expected an integer degree, got {value!r}")
    return value


def _converters(doc: ConfigDoc) -> list[str]:
    """``[model] converters``: a list, or the older comma-separated string."""
    value = doc.get("model.converters", [])
    if isinstance(value, str):
        return [c.strip() for c in value.split(",") if c.strip()]
    if not isinstance(value, list):
        raise ValueError(f"{doc.loc('model.converters')}: expected a list, got {value!r}")
    return [str(c).strip() for c in value]


def _fp8(doc: ConfigDoc, converters: list[str]) -> tuple[bool, str | None, str]:
    """(enabled, scaling recipe, detail) from the fp8/MX converters."""
    float8 = [c for c in converters if c.split(".")[-1] == "float8"]
    mx = [c for c in converters if c.split(".")[-1] == "mx"]
    if not float8 and not mx:
        return False, None, ""
    recipes: list[str] = []
    if float8:
        key = (
            "quantize.linear.float8.recipe_name"
            if doc.has("quantize.linear.float8.recipe_name")
            else "float8.recipe_name"
        )
        recipe = config_str(doc, key)
        if recipe is not None:  # Float8LinearConfig.from_recipe_name asserts a known name
            recipe = check_choice(doc, key, recipe, TORCHAO_RECIPES)
        recipes.append(f"torchao float8 {recipe or 'tensorwise'} scaling")
    if mx:
        recipe = config_str(doc, "quantize.linear.mx.recipe_name") or config_str(
            doc, "mx.recipe_name"
        )
        recipes.append(f"torchao MX block scaling ({recipe or 'mxfp8_cublas'})")
    detail = f"model.converters: {', '.join(float8 + mx)} (fp8 matmuls via torchao)"
    return True, "; ".join(recipes), detail


def facts_from_torchtitan(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read a torchtitan TOML job config into `TrainingFacts`.

    Raises:
        ValueError: for an unknown dtype name, a non-integer parallel degree or
            malformed ``converters``.
    """
    for table in ("training", "parallelism", "optimizer", "model"):
        doc.mapping(table)  # ValueError when present but not a table
    storage = _dtype(doc, "training.dtype", "float32")
    mp_param = _dtype(doc, "training.mixed_precision_param", "bfloat16")
    mp_reduce = _dtype(doc, "training.mixed_precision_reduce", "float32")
    dp_shard = _degree(doc, "parallelism.data_parallel_shard_degree", -1)
    dp_replicate = _degree(doc, "parallelism.data_parallel_replicate_degree", 1)
    cp = _degree(doc, "parallelism.context_parallel_degree", 1)
    tp = _degree(doc, "parallelism.tensor_parallel_degree", 1)
    pp = _degree(doc, "parallelism.pipeline_parallel_degree", 1)
    steps = config_int(doc, "training.steps")
    if steps is not None and steps <= 0:
        raise ValueError(
            f"{doc.loc('training.steps')}: must be > 0, got {steps}: torchtitan trains while "
            "step < training.steps (train.py should_continue_training), so no step would run"
        )

    storage_note = (
        "training.dtype: bfloat16 builds the model in bf16 (full bf16 training, no fp32 copy)"
        if storage != "fp32"
        else "torchtitan builds the model in training.dtype (default float32)"
    )
    reduce_dtype: str | None
    if dp_shard != 1 or cp > 1:
        compute: str = mp_param
        reduce_dtype = mp_reduce
        reduce_note = (
            f"FSDP2 MixedPrecisionPolicy(reduce_dtype={mp_reduce}) from "
            "training.mixed_precision_reduce (apply_fsdp)"
        )
    else:
        compute = storage if (tp > 1 or pp > 1) else mp_param
        reduce_dtype = storage if dp_replicate > 1 else None
        reduce_note = (
            f"no FSDP: DDP reduces gradients in the parameters' dtype ({storage})"
            if dp_replicate > 1
            else ""
        )

    name = config_str(doc, "optimizer.name", "an optimizer name (AdamW...)") or "AdamW"
    optimizer = None
    if name in ADAM_OPTIMIZERS:
        optimizer = OptimizerFacts(
            name=f"torch.optim.{name}",
            state=("exp_avg", "exp_avg_sq"),
            groups=(GroupFacts(param_dtype=storage, master="none", moments=_MOMENTS[storage]),),
            note=f"torchtitan's {name} keeps its moments in the parameters' dtype",
        )

    fp8, scaling, detail = _fp8(doc, _converters(doc))
    emulate_key = (
        "quantize.linear.float8.emulate"
        if doc.has("quantize.linear.float8.emulate")
        else "float8.emulate"
    )
    emulated = config_value(doc, emulate_key, (bool,), "true or false") is True
    emulated_by = f"[{emulate_key.rsplit('.', 1)[0]}] emulate = true"
    mp_where = doc.loc("training.mixed_precision_param", "parallelism", "training")
    where = {
        "param_dtype": doc.loc("training.dtype", "training"),
        "compute_dtype": mp_where,
        "loss_scaling": doc.loc("training.dtype", "training"),
        "optimizer": doc.loc("training.dtype", "optimizer.name", "optimizer"),
        "master": doc.loc("training.dtype", "optimizer.name", "optimizer"),
        "reduce_dtype": doc.loc(
            "training.mixed_precision_reduce", "parallelism.data_parallel_shard_degree", "training"
        ),
        "fp8": doc.loc("model.converters", "model"),
    }
    return TrainingFacts(
        source=doc.source,
        dialect="torchtitan",
        param_dtype=storage,
        param_dtype_note=storage_note,
        compute_dtype=compute,
        loss_scaling=False,
        optimizer=optimizer,
        reduce_dtype=reduce_dtype,
        reduce_note=reduce_note,
        fp8_enabled=fp8,
        fp8_scaling=scaling,
        fp8_detail=detail,
        fp8_emulated=fp8 and emulated,
        fp8_emulated_by=emulated_by if fp8 and emulated else "",
        steps=steps if steps is not None else 10000,  # Training.steps' default
        device=device,
        where=where,
    )


def claims_torchtitan(data: Mapping[str, Any]) -> bool:
    """A torchtitan job config: a ``[job]`` table, or ``[training]`` with
    ``[parallelism]``, among torchtitan's top-level tables."""
    tables = {k for k, v in data.items() if k in TORCHTITAN_SECTIONS and isinstance(v, Mapping)}
    return ("job" in tables and len(tables) >= 2) or {"training", "parallelism"} <= tables


#: torchtitan TOML job configs as a front end (see `dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="torchtitan",
    claims=claims_torchtitan,
    read=facts_from_torchtitan,
    hint="a torchtitan job config has '[job]', '[training]', '[parallelism]' tables",
    keys=TORCHTITAN_SECTIONS | {"quantize", "float8", "mx"},
)
