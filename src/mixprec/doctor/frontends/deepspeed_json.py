"""DeepSpeed config files (JSON, or the same keys in YAML), read into `TrainingFacts`.

The semantics come from DeepSpeed's own source (deepspeedai/DeepSpeed):

* ``deepspeed/runtime/precision_config.py``: ``fp16.enabled``, ``fp16.loss_scale``
  (0, the default, means dynamic loss scaling; a positive value is a static
  scale), ``fp16.fp16_master_weights_and_grads`` (masters kept in fp16),
  ``bf16.enabled`` (older spelling ``bfloat16``),
  ``bf16.bf16_master_weights_and_grads`` and ``bf16.bf16_optimizer_states``
  (masters and, optionally, optimizer states kept in bf16).
* ``deepspeed/runtime/engine.py`` (``DeepSpeedEngine.communication_data_type``):
  an unset ``communication_data_type`` communicates gradients in fp16 when fp16
  is enabled and in bf16 when bf16 is; fp32 otherwise.
* With fp16 or bf16 enabled the engine casts the model to that dtype and its
  optimizer wrappers (``FP16_Optimizer``, ``BF16_Optimizer``, the ZeRO stage
  1-3 optimizers) keep an fp32 master partition that the wrapped optimizer
  updates, so moments are fp32 too, unless the ``*_master_weights_and_grads``
  options above say otherwise.

``"auto"`` values (filled in later by the HF Trainer or Accelerate) are unknown
facts, and the rules that need them stay silent. Optimizer ``type`` names are
compared against `ADAM_TYPES`; nothing is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, TrainingFacts
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.optimizers import config_bool, config_dtype, torch_state
from mixprec.doctor.frontends.values import config_str, config_value

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "ADAM_TYPES",
    "DEEPSPEED_MARKERS",
    "FRONT_END",
    "claims_deepspeed",
    "facts_from_deepspeed",
]

#: Top-level keys only a DeepSpeed config has.
DEEPSPEED_MARKERS: frozenset[str] = frozenset(
    {
        "zero_optimization",
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
        "communication_data_type",
        "zero_allow_untested_optimizer",
        "steps_per_print",
        "wall_clock_breakdown",
    }
)

#: DeepSpeed optimizer ``type`` names (lower case) that keep Adam-style moments.
ADAM_TYPES: frozenset[str] = frozenset(
    {
        "adam",
        "adamw",
        "fusedadam",
        "cpuadam",
        "onebitadam",
        "zerooneadam",
        "lamb",
        "onebitlamb",
        "fusedlamb",
    }
)
#: DeepSpeed optimizer ``type`` names without Adam moments.
OTHER_TYPES: frozenset[str] = frozenset({"sgd", "adagrad", "lion", "fusedlion", "cpulion"})


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _enabled(doc: ConfigDoc, section: str) -> bool | None:
    """Whether ``section.enabled`` is on; None for ``"auto"``."""
    value = doc.get(f"{section}.enabled")
    if _is_auto(value):
        return None
    return config_bool(doc, f"{section}.enabled", value, False)


def _loss_scale(doc: ConfigDoc) -> float:
    """``fp16.loss_scale``: 0 (the default, and ``"auto"``) is dynamic scaling."""
    raw = doc.get("fp16.loss_scale", 0)
    if _is_auto(raw) or raw is None:
        return 0.0
    if isinstance(raw, bool) or not isinstance(raw, int | float) or raw < 0:
        raise ValueError(
            f"{doc.loc('fp16.loss_scale')}: must be a number >= 0 (0: dynamic), got {raw!r}"
        )
    return float(raw)


def _refused(doc: ConfigDoc, bf16_key: str, fp16: bool | None, bf16: bool | None) -> None:
    """Raise for combinations `DeepSpeedConfig` refuses (``deepspeed/runtime/config.py``:
    the fp16/bf16 assertion in ``_initialize_params``, the master/state checks in
    ``_do_error_check``), so a config DeepSpeed would not start is never judged."""
    if fp16 and bf16:
        raise ValueError(
            f"{doc.loc(f'{bf16_key}.enabled')}: fp16.enabled and {bf16_key}.enabled are both "
            "true: DeepSpeed refuses the config ('bfloat16 and fp16 modes cannot be "
            "simultaneously enabled', DeepSpeedConfig); enable one of them"
        )
    flags = {
        path: config_bool(doc, path, doc.get(path), False)
        for path in (
            "fp16.fp16_master_weights_and_grads",
            f"{bf16_key}.bf16_master_weights_and_grads",
            f"{bf16_key}.bf16_optimizer_states",
        )
    }
    states, masters = (
        f"{bf16_key}.bf16_optimizer_states",
        f"{bf16_key}.bf16_master_weights_and_grads",
    )
    if flags[states] and not flags[masters]:
        raise ValueError(
            f"{doc.loc(states)}: {states} without {masters}: DeepSpeed refuses it "
            "('bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled'); "
            f"drop {states} (fp32 optimizer states) or set both"
        )
    stage = doc.get("zero_optimization.stage", 0)
    if _is_auto(stage):
        return
    stage = config_value(doc, "zero_optimization.stage", (int,), 'a ZeRO stage (0-3) or "auto"')
    on = [path for path, value in flags.items() if value]
    if on and not (isinstance(stage, int) and stage >= 1):
        where = "zero_optimization.stage" if doc.has("zero_optimization.stage") else on[0]
        raise ValueError(
            f"{doc.loc(where)}: {on[0]} needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is "
            f"{stage or 0}): DeepSpeed refuses it ('... is only supported with ZeRO Stage 1, "
            "2, or 3'); drop it (DeepSpeed then keeps fp32 masters) or enable ZeRO"
        )


def _optimizer(
    doc: ConfigDoc, storage: str, master: str, moments: str, note: str
) -> OptimizerFacts | None:
    section = doc.mapping("optimizer")
    raw_kind = config_str(doc, "optimizer.type", "an optimizer type (AdamW...)")
    if section is None or raw_kind is None:
        return None  # the optimizer is passed to deepspeed.initialize in code: unknown
    kind = raw_kind.strip()
    params = doc.mapping("optimizer.params") or {}
    torch_adam = config_bool(doc, "optimizer.params.torch_adam", params.get("torch_adam"), False)
    name = f"DeepSpeed {kind}" + (" (torch_adam: torch.optim)" if torch_adam else "")
    state: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    if kind.lower() in OTHER_TYPES:
        state = (
            torch_state("SGD", params)
            if kind.lower() == "sgd"
            else ("sum",)
            if kind.lower() == "adagrad"
            else ("exp_avg",)
        )
    elif kind.lower() not in ADAM_TYPES:
        return None
    return OptimizerFacts(
        name=name,
        state=state,
        groups=(GroupFacts(param_dtype=storage, master=master, moments=moments),),
        note=note,
    )


def facts_from_deepspeed(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read a DeepSpeed config into `TrainingFacts`.

    Raises:
        ValueError: for values that are not valid (a non-boolean ``enabled``...).
    """
    bf16_key = "bf16" if doc.has("bf16") or not doc.has("bfloat16") else "bfloat16"
    for section in ("fp16", bf16_key, "zero_optimization"):
        doc.mapping(section)  # ValueError when present but not a mapping
    fp16 = _enabled(doc, "fp16")
    bf16 = _enabled(doc, bf16_key)
    _refused(doc, bf16_key, fp16, bf16)

    storage: str | None
    loss_scaling: bool | None = False
    master, moments, note = "fp32", "fp32", ""
    if fp16:
        storage = "fp16"
        scale = _loss_scale(doc)
        loss_scaling = scale == 0 or scale > 1
        if config_bool(
            doc,
            "fp16.fp16_master_weights_and_grads",
            doc.get("fp16.fp16_master_weights_and_grads"),
            False,
        ):
            master, note = "fp16", "fp16.fp16_master_weights_and_grads: masters kept in fp16"
        else:
            note = "FP16_Optimizer/ZeRO keep an fp32 master partition and fp32 moments"
    elif bf16:
        storage = "bf16"
        if config_bool(
            doc,
            f"{bf16_key}.bf16_master_weights_and_grads",
            doc.get(f"{bf16_key}.bf16_master_weights_and_grads"),
            False,
        ):
            states = config_bool(
                doc,
                f"{bf16_key}.bf16_optimizer_states",
                doc.get(f"{bf16_key}.bf16_optimizer_states"),
                False,
            )
            master, moments = "none", "bf16" if states else "fp32"
            note = "bf16_master_weights_and_grads: the master is bf16, as the parameters"
        else:
            note = "BF16_Optimizer/ZeRO keep an fp32 master partition and fp32 moments"
    elif fp16 is None or bf16 is None:
        storage, loss_scaling = None, None  # "auto": decided by the launcher
    else:
        storage, master, note = "fp32", "none", ""

    reduce_dtype: str | None = None
    reduce_note = ""
    raw_comm = doc.get("communication_data_type")
    if raw_comm is not None and not _is_auto(raw_comm):
        reduce_dtype = config_dtype(doc, "communication_data_type", raw_comm)
    elif storage is not None:
        reduce_dtype = storage
        if storage != "fp32":
            reduce_note = (
                f"communication_data_type unset: DeepSpeed communicates gradients in the "
                f"training dtype ({storage})"
            )

    for section in ("scheduler", "scheduler.params"):
        doc.mapping(section)  # ValueError when present but not a mapping
    steps = doc.get("scheduler.params.total_num_steps")
    if not _is_auto(steps):  # "auto": filled in by the HF Trainer
        steps = config_value(
            doc, "scheduler.params.total_num_steps", (int,), 'an integer or "auto"'
        )
    else:
        steps = None
    if steps is not None and steps <= 0:
        # a learning-rate schedule length, not a run length: DeepSpeed accepts it (only
        # warns below warmup_num_steps, lr_schedules.py) and the loop in code decides
        steps = None

    precision_where = doc.loc(
        "fp16.enabled", f"{bf16_key}.enabled", "fp16", bf16_key, "zero_optimization"
    )
    where = {
        "param_dtype": precision_where,
        "compute_dtype": precision_where,
        "loss_scaling": doc.loc("fp16.loss_scale", "fp16.enabled", "fp16"),
        "optimizer": doc.loc(
            "fp16.fp16_master_weights_and_grads",
            f"{bf16_key}.bf16_master_weights_and_grads",
            "optimizer.type",
            "optimizer",
        ),
        "master": doc.loc(
            "fp16.fp16_master_weights_and_grads",
            f"{bf16_key}.bf16_master_weights_and_grads",
            "optimizer.type",
        ),
        "reduce_dtype": doc.loc("communication_data_type", "fp16.enabled", f"{bf16_key}.enabled"),
    }
    return TrainingFacts(
        source=doc.source,
        dialect="deepspeed",
        param_dtype=storage,
        compute_dtype=storage,
        loss_scaling=loss_scaling,
        optimizer=_optimizer(doc, storage, master, moments, note) if storage else None,
        reduce_dtype=reduce_dtype,
        reduce_note=reduce_note,
        steps=steps,
        device=device,
        where=where,
    )


def _precision_section(value: Any) -> bool:
    return isinstance(value, Mapping) and "enabled" in value


def claims_deepspeed(data: Mapping[str, Any]) -> bool:
    """A DeepSpeed config: a DeepSpeed-only top-level key (`DEEPSPEED_MARKERS`), or an
    ``fp16``/``bf16`` mapping with an ``enabled`` key (the HF Trainer's are booleans)."""
    return bool(DEEPSPEED_MARKERS & set(data)) or any(
        _precision_section(data.get(k)) for k in ("fp16", "bf16", "bfloat16")
    )


#: DeepSpeed JSON as a front end (see `mixprec.doctor.frontends.dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="deepspeed",
    claims=claims_deepspeed,
    read=facts_from_deepspeed,
    hint="a DeepSpeed config has 'zero_optimization:', 'train_micro_batch_size_per_gpu:'...",
    keys=DEEPSPEED_MARKERS | {"fp16", "bf16", "bfloat16", "optimizer", "scheduler"},
)
