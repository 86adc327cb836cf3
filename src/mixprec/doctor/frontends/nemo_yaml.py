"""NeMo AutoModel recipes (YAML), read into `TrainingFacts`.

What is read (everything else is ignored):

* ``model.torch_dtype`` (or ``model.dtype``): the resident parameter dtype. Unset
  or ``auto`` loads the checkpoint's dtype, commonly bf16, and is taken as bf16;
  except in the knowledge-distillation recipes, whose ``resolve_storage_dtype``
  makes it float32 for full-parameter training with a ``torch.optim`` optimizer,
  and for a ``model._target_`` other than NeMo's auto-model loaders (a builder
  such as ``build_gpt2_model``), where it is unknown. LoRA adapters take
  ``peft.lora_dtype``, else the base weights' dtype.
* ``optimizer._target_`` (or ``optimizer.name`` + ``kwargs``): torch.optim Adam
  family, Transformer Engine ``FusedAdam`` (``master_weights``,
  ``master_weight_dtype``, ``store_param_remainders``, ``exp_avg_dtype``,
  ``exp_avg_sq_dtype``), ``flashoptim.FlashAdamW`` (``master_weight_bits``),
  torchao and torch-optimi AdamW variants, ``mixprec.optim.AdamW``.
* ``distributed``/``distributed_config``: ``strategy`` (fsdp2, megatron_fsdp,
  ddp), ``mp_policy`` (an FSDP2 ``MixedPrecisionPolicy`` spelled as a
  ``_target_`` mapping: ``param_dtype``, ``reduce_dtype``, ``output_dtype``),
  ``grad_reduce_in_fp32`` (Megatron FSDP), ``autocast_dtype``; top-level
  ``autocast: {enabled, dtype}``. The diffusion recipe's top-level ``ddp:``
  (DDP) and ``fsdp.reduce_dtype`` (FSDP2, default float32).
* ``peft`` (adapters only), ``step_scheduler.max_steps`` (run length),
  ``loss_fn.fp32_upcast``, ``fp8`` (torchao recipe) and ``model.backend.te_fp8``.

``_target_`` strings are compared against the allowlists below; nothing is
imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mixprec.doctor.facts import (
    TrainingFacts,
)
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.fp8_recipes import (
    AMAX_ALGOS,
    TORCHAO_RECIPES,
    check_choice,
    describe_te_delayed,
)
from mixprec.doctor.frontends.frontend import FrontEnd
from mixprec.doctor.frontends.nemo_values import (
    UnknownValueError,
    Unresolved,
    nemo_view,
    unresolved_paths,
)
from mixprec.doctor.frontends.optimizers import (
    FLASHOPTIM_TARGETS,
    MIXPREC_TARGETS,
    OPTIMI_TARGETS,
    TE_FUSED_ADAM_TARGETS,
    TORCH_TARGETS,
    TORCHAO_TARGETS,
    config_bool,
    config_dtype,
    optimizer_facts,
)
from mixprec.doctor.frontends.values import config_int, config_str
from mixprec.floats import is_16bit_name, is_fp8_name

if TYPE_CHECKING:  # a device is probed only when asked for
    from mixprec.device import DeviceCaps

__all__ = [
    "AUTO_MODEL_PREFIX",
    "DIFFUSION_TE_RECIPES",
    "FLASHOPTIM_TARGETS",
    "FP32_DEFAULT_RECIPES",
    "FRONT_END",
    "MIXPREC_TARGETS",
    "MP_POLICY_TARGETS",
    "NEMO_MARKERS",
    "OPTIMI_TARGETS",
    "TE_FUSED_ADAM_TARGETS",
    "TORCHAO_TARGETS",
    "TORCH_TARGETS",
    "claims_nemo",
    "facts_from_nemo",
]

#: Top-level keys that mark a NeMo AutoModel recipe.
NEMO_MARKERS: frozenset[str] = frozenset(
    {
        "step_scheduler",
        "dist_env",
        "recipe",
        "peft",
        "loss_fn",
        "distributed_config",
        "packed_sequence",
        "validation_dataset",
        "dataloader",
        "autopipeline",
        "parallelizer",
    }
)

#: FSDP2 MixedPrecisionPolicy spellings.
MP_POLICY_TARGETS: frozenset[str] = frozenset(
    {
        "torch.distributed.fsdp.MixedPrecisionPolicy",
        "torch.distributed._composable.fsdp.MixedPrecisionPolicy",
        "torch.distributed.fsdp._fully_shard.MixedPrecisionPolicy",
        "torch.distributed.fsdp._fully_shard._fsdp_api.MixedPrecisionPolicy",
    }
)

_AUTO_NOTE = (
    "model.torch_dtype {how}: NeMo AutoModel / Hugging Face load the checkpoint's dtype, "
    "commonly bf16; treated as bf16"
)
_FP32_DEFAULT_NOTE = (
    "model.torch_dtype {how}: this recipe defaults it to float32 for full-parameter training "
    "with a torch.optim optimizer (resolve_storage_dtype)"
)

#: Recipes whose ``setup`` calls ``resolve_storage_dtype``
#: (``nemo_automodel/components/optim/precision_warnings.py``; the LLM and VLM
#: knowledge-distillation recipes at NVIDIA-NeMo/Automodel 36044ad): an unset or ``auto``
#: ``model.torch_dtype`` becomes float32 when a ``torch.optim.`` optimizer trains every
#: parameter, so the parameters are the fp32 master.
FP32_DEFAULT_RECIPES: tuple[str, ...] = ("KnowledgeDistillationRecipe",)

#: ``model._target_`` prefix of NeMo's auto-model loaders, whose unset/``auto`` dtype is the
#: checkpoint's (``from_pretrained``) or bf16 (``from_config``). Another builder
#: (``build_gpt2_model``...) makes the model in its own dtype: unknown here.
AUTO_MODEL_PREFIX = "nemo_automodel.NeMoAutoModel"


def _fp32_default(doc: ConfigDoc) -> bool:
    """Whether NeMo's ``resolve_storage_dtype`` turns an unset or ``auto``
    ``model.torch_dtype`` into float32: the recipes that call it
    (`FP32_DEFAULT_RECIPES`), full-parameter training, a ``torch.optim.`` optimizer."""
    recipe = doc.get("recipe")
    if isinstance(recipe, Mapping):
        recipe = recipe.get("_target_")
    target = doc.get("optimizer._target_")
    return (
        isinstance(recipe, str)
        and any(name in recipe for name in FP32_DEFAULT_RECIPES)
        and doc.get("peft") is None
        and isinstance(target, str)
        and target.strip().startswith("torch.optim.")
    )


def _param_dtype(doc: ConfigDoc) -> tuple[str | None, str]:
    # Both reach transformers' from_pretrained as keyword arguments, where `dtype` wins
    # over the deprecated `torch_dtype` (modeling_utils: dtype if dtype is not None else
    # torch_dtype), as in the HF Trainer front end.
    key = "model.dtype" if doc.get("model.dtype") is not None else "model.torch_dtype"
    raw = doc.get(key)
    if isinstance(raw, Unresolved):
        return None, f"{key} {raw.token}: set by the run's environment, unknown here"
    unset = raw is None or (isinstance(raw, str) and raw.strip().lower() == "auto")
    if unset and _fp32_default(doc):
        how = "unset" if raw is None else "auto"
        return "fp32", _FP32_DEFAULT_NOTE.format(how=how)
    builder = doc.get("model._target_")
    if unset and isinstance(builder, str) and not builder.startswith(AUTO_MODEL_PREFIX):
        return None, f"model._target_ {builder} builds the model; its dtype is not in the recipe"
    if raw is None:
        return "bf16", _AUTO_NOTE.format(how="unset")
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "bf16", _AUTO_NOTE.format(how="auto")
    dt = config_dtype(doc, key, raw)
    return (dt, "") if dt is not None else ("bf16", _AUTO_NOTE.format(how="null"))


def _mp_policy(doc: ConfigDoc) -> tuple[str, Mapping[str, Any]] | None:
    for path in ("distributed.mp_policy", "distributed_config.mp_policy"):
        mp = doc.mapping(path)
        if mp is not None:
            target = config_str(doc, f"{path}._target_", "a dotted class name")
            if target is not None and target not in MP_POLICY_TARGETS:
                return None
            return path, mp
    return None


def _strategy(doc: ConfigDoc) -> str | None:
    """``fsdp2``, ``megatron_fsdp`` or ``ddp``; None when left to the environment."""
    for section in ("distributed", "distributed_config"):
        doc.mapping(section)  # ValueError when present but not a mapping
    try:
        raw = config_str(doc, "distributed.strategy", "fsdp2, megatron_fsdp or ddp")
    except UnknownValueError:
        return None
    target = (
        config_str(doc, "distributed._target_", "a dotted class name")
        or config_str(doc, "distributed_config._target_", "a dotted class name")
        or ""
    )
    name = raw.lower() if raw is not None else target.lower()
    if "megatron" in name or name == "mfsdp":
        return "megatron_fsdp"
    if "ddp" in name:
        return "ddp"
    if not name and doc.mapping("ddp") is not None:
        return "ddp"  # the diffusion recipe's top-level ddp: section
    return "fsdp2"


#: The diffusion recipe's ``model.transformer_engine_fp8_recipe`` spellings
#: (``recipes/diffusion/train.py`` ``_build_transformer_engine_fp8_recipe``, after
#: ``replace("-", "_").lower()``) -> the Transformer Engine recipe it builds.
DIFFUSION_TE_RECIPES: dict[str, str] = {
    "delayed": "DelayedScaling",
    "delayed_scaling": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "current_scaling": "Float8CurrentScaling",
    "mxfp8": "MXFP8BlockScaling",
    "mx": "MXFP8BlockScaling",
    "mx_fp8": "MXFP8BlockScaling",
}


def _diffusion_te_recipe(doc: ConfigDoc) -> str:
    """``model.transformer_engine_fp8_*`` of the diffusion recipe: its TE recipe, which
    raises ValueError for an unknown name ("must be one of 'delayed', 'current', or
    'mxfp8'"); delayed scaling takes the history length (default 1024) and the
    compute algorithm (default ``max``)."""
    key = "model.transformer_engine_fp8_recipe"
    name = config_str(doc, key, "delayed, current or mxfp8") or "delayed"
    kind = DIFFUSION_TE_RECIPES.get(name.replace("-", "_").lower())
    if kind is None:
        raise ValueError(
            f"{doc.loc(key)}: unknown recipe {name!r}; the diffusion recipe accepts "
            "delayed, current or mxfp8"
        )
    if kind != "DelayedScaling":
        return f"Transformer Engine {kind} ({key}: {name})"
    history = config_int(doc, "model.transformer_engine_fp8_amax_history_len")
    algo_raw = config_str(doc, "model.transformer_engine_fp8_amax_compute_algo")
    algo = (
        "max"
        if algo_raw is None
        else check_choice(
            doc, "model.transformer_engine_fp8_amax_compute_algo", algo_raw, AMAX_ALGOS
        )
    )
    return describe_te_delayed(
        fp8_format=None, history=1024 if history is None else history, algo=algo, margin=None
    )


def facts_from_nemo(doc: ConfigDoc, *, device: DeviceCaps | None = None) -> TrainingFacts:
    """Read a NeMo AutoModel recipe into `TrainingFacts`.

    Raises:
        ValueError: for values that are not valid (an unknown dtype spelling...).
    """
    doc = nemo_view(doc)  # values as NeMo's loader reads them (translate_value)
    for section in ("model", "optimizer", "autocast", "step_scheduler", "loss_fn"):
        if not isinstance(doc.get(section), Unresolved):
            doc.mapping(section)  # ValueError when present but not a mapping
    unknown = tuple(
        f"{doc.loc(path)}: {value.token} (set by the run's environment)"
        for path, value in unresolved_paths(doc.data)
    )
    storage, storage_note = _param_dtype(doc)
    strategy = _strategy(doc)
    mp = _mp_policy(doc)
    mp_path = mp[0] if mp else "distributed.mp_policy"
    mp_values: Mapping[str, Any] = mp[1] if mp else {}

    def dtypes() -> tuple[str | None, str | None, str, str | None, str]:
        if strategy is None:
            raise UnknownValueError("distributed.strategy")
        autocast: str | None = None
        autocast_path = ""
        if config_bool(
            doc, "autocast.enabled", doc.get("autocast.enabled"), doc.has("autocast.dtype")
        ):
            autocast, autocast_path = (
                config_dtype(doc, "autocast.dtype", doc.get("autocast.dtype")),
                "autocast.dtype",
            )
        for path in ("distributed.autocast_dtype", "distributed_config.autocast_dtype"):
            if autocast is None and doc.get(path) is not None:
                autocast, autocast_path = config_dtype(doc, path, doc.get(path)), path

        mp_param = config_dtype(doc, f"{mp_path}.param_dtype", mp_values.get("param_dtype"))
        reduce_note = ""
        if strategy == "fsdp2":
            if mp is None and doc.has("distributed.mp_policy"):
                compute: str | None = None  # an mp_policy we cannot read
                reduce_dtype: str | None = None
            elif mp is None:
                compute, reduce_dtype = "bf16", "fp32"  # FSDP2Config's default
                if doc.get("fsdp.reduce_dtype") is not None:  # the diffusion recipe's fsdp:
                    reduce_dtype = config_dtype(
                        doc, "fsdp.reduce_dtype", doc.get("fsdp.reduce_dtype")
                    )
            else:
                compute = mp_param or storage
                reduce_dtype = config_dtype(
                    doc, f"{mp_path}.reduce_dtype", mp_values.get("reduce_dtype")
                )
                if reduce_dtype is None:
                    reduce_dtype = compute
                    reduce_note = (
                        f"{mp_path}.reduce_dtype unset: FSDP2 then reduces in the compute dtype"
                    )
        elif strategy == "megatron_fsdp":
            compute = storage
            in_fp32 = config_bool(
                doc,
                "distributed.grad_reduce_in_fp32",
                doc.get("distributed.grad_reduce_in_fp32"),
                False,
            )
            reduce_dtype = "fp32" if in_fp32 else storage
            if not in_fp32:
                reduce_note = (
                    "grad_reduce_in_fp32 is false (the default): Megatron FSDP reduces in the "
                    "parameters' dtype"
                )
        else:
            compute, reduce_dtype = storage, storage
            reduce_note = "DDP all-reduces gradients in the parameters' dtype"
        if autocast is not None:
            compute = autocast

        output = (
            config_dtype(doc, f"{mp_path}.output_dtype", mp_values.get("output_dtype")) or compute
        )
        return compute, reduce_dtype, reduce_note, output, autocast_path

    try:
        compute, reduce_dtype, reduce_note, output, autocast_path = dtypes()
    except UnknownValueError:  # a dtype left to the run's environment: unknown, never guessed
        compute, reduce_dtype, reduce_note, output, autocast_path = None, None, "", None, ""
    upcast = doc.get("loss_fn.fp32_upcast")
    loss_fp32: bool | None = None
    if upcast is not None and output is not None and not isinstance(upcast, Unresolved):
        loss_fp32 = config_bool(doc, "loss_fn.fp32_upcast", upcast, True) or not is_16bit_name(
            output
        )

    fp8_enabled, fp8_scaling, fp8_detail = False, None, ""
    fp8_emulated, fp8_emulated_by = False, ""
    fp8 = doc.mapping("fp8")
    fp8_on = fp8.get("enabled") if fp8 is not None else None
    if (
        fp8 is not None
        and not isinstance(fp8_on, Unresolved)
        and config_bool(doc, "fp8.enabled", fp8_on, False)
    ):
        raw_recipe = fp8.get("recipe_name")
        recipe: str | None
        if isinstance(raw_recipe, Unresolved):
            recipe = str(raw_recipe)  # a recipe the run's environment names: a recipe all the same
        else:
            name = config_str(doc, "fp8.recipe_name", "a recipe name (tensorwise...)")
            # FP8Config.recipe_name reaches Float8LinearConfig.from_recipe_name, which
            # asserts one of torchao's names (components/quantization/fp8.py).
            recipe = (
                None
                if name is None
                else check_choice(doc, "fp8.recipe_name", name, TORCHAO_RECIPES)
            )
        fp8_enabled = True
        fp8_scaling = f"torchao float8 {recipe or 'tensorwise (NeMo default)'}"
        emulate = fp8.get("emulate")
        if emulate is not None and not isinstance(emulate, Unresolved):
            fp8_emulated = config_bool(doc, "fp8.emulate", emulate, False)
            fp8_emulated_by = "fp8.emulate: true" if fp8_emulated else ""
    te_fp8 = doc.mapping("model.backend.te_fp8")
    if te_fp8 is not None:
        fp8_enabled = True
        te_recipe = te_fp8.get("recipe")
        if te_recipe is None or isinstance(te_recipe, Unresolved):
            fp8_scaling = "Transformer Engine Float8CurrentScaling (TEFp8Config default)"
        else:
            # TEFp8Config.build_recipe: "mxfp8", "block", anything else current scaling.
            word = config_str(doc, "model.backend.te_fp8.recipe", "a recipe name") or ""
            fp8_scaling = {
                "mxfp8": "Transformer Engine MXFP8BlockScaling",
                "block": "Transformer Engine Float8BlockScaling",
            }.get(word.strip(), f"Transformer Engine Float8CurrentScaling (recipe: {word})")
    if doc.get("model.transformer_engine_fp8") is not None and config_bool(
        doc, "model.transformer_engine_fp8", doc.get("model.transformer_engine_fp8"), False
    ):
        fp8_enabled = True
        fp8_scaling = _diffusion_te_recipe(doc)
    if storage is not None and is_fp8_name(storage):
        fp8_enabled, fp8_scaling = True, None
        fp8_detail = f"model.torch_dtype {storage}: parameters stored in fp8 with no scale"
    elif compute is not None and is_fp8_name(compute):
        fp8_enabled, fp8_scaling = True, None
        fp8_detail = f"compute cast to {compute} with no scale"

    peft = None if isinstance(doc.get("peft"), Unresolved) else doc.mapping("peft")
    steps = doc.get("step_scheduler.max_steps")
    if isinstance(steps, Unresolved):
        steps = None  # reported in `unknown`
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        raise ValueError(
            f"{doc.loc('step_scheduler.max_steps')}: must be an integer, got {steps!r}"
        )
    if steps is not None and steps <= 0:
        raise ValueError(
            f"{doc.loc('step_scheduler.max_steps')}: must be > 0 or null (null: from "
            f"num_epochs), got {steps}: NeMo AutoModel's StepScheduler refuses it "
            "('max_steps must be greater than 0')"
        )

    optimizer = None
    if storage is not None:  # the optimizer's state depends on the storage dtype
        try:
            # LoRA adapters take peft.lora_dtype, else the base weights' dtype
            # (nemo_automodel/components/_peft/lora.py)
            lora = doc.get("peft.lora_dtype") if isinstance(peft, Mapping) else None
            trainable = config_dtype(doc, "peft.lora_dtype", lora) or storage
            optimizer = optimizer_facts(doc, trainable)
        except UnknownValueError:
            optimizer = None
    compute_where = doc.loc(
        autocast_path or f"{mp_path}.param_dtype",
        mp_path,
        "distributed",
        "model.torch_dtype",
        "model",
    )
    where = {
        "param_dtype": doc.loc("model.torch_dtype", "model.dtype", "model"),
        "compute_dtype": compute_where,
        "loss_scaling": compute_where,
        "optimizer": doc.loc("optimizer._target_", "optimizer.name", "optimizer"),
        "master": doc.loc(
            "optimizer.master_weights",
            "optimizer.kwargs.master_weights",
            "optimizer.master",
            "optimizer._target_",
            "optimizer.name",
        ),
        "reduce_dtype": doc.loc(
            f"{mp_path}.reduce_dtype",
            "fsdp.reduce_dtype",
            "distributed.grad_reduce_in_fp32",
            mp_path,
            "distributed.strategy",
            "distributed",
            "ddp",
        ),
        "loss": doc.loc("loss_fn.fp32_upcast", "loss_fn"),
        "fp8": doc.loc(
            "fp8.recipe_name",
            "fp8",
            "model.backend.te_fp8",
            "model.transformer_engine_fp8",
            "model.torch_dtype",
        ),
        "fp8_emulated": doc.loc("fp8.emulate", "fp8"),
    }
    return TrainingFacts(
        source=doc.source,
        dialect="nemo",
        param_dtype=storage,
        param_dtype_note=storage_note,
        compute_dtype=compute,
        loss_scaling=False,  # NeMo AutoModel recipes declare no loss scaler
        optimizer=optimizer,
        reduce_dtype=reduce_dtype,
        reduce_note=reduce_note,
        loss_fp32=loss_fp32,
        fp8_enabled=fp8_enabled,
        fp8_scaling=fp8_scaling,
        fp8_detail=fp8_detail,
        fp8_emulated=fp8_emulated,
        fp8_emulated_by=fp8_emulated_by,
        peft=bool(peft),
        steps=steps,
        unknown=unknown,
        device=device,
        where=where,
    )


def _has_target(node: Any) -> bool:
    if isinstance(node, Mapping):
        return "_target_" in node or any(_has_target(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_target(v) for v in node)
    return False


def claims_nemo(data: Mapping[str, Any]) -> bool:
    """A NeMo AutoModel recipe: a NeMo top-level key (`NEMO_MARKERS`), a
    ``model._target_`` or ``model.torch_dtype``, or any ``_target_`` key; never a
    ``base_model`` config without ``_target_`` (axolotl's)."""
    if "base_model" in data and not _has_target(data):
        return (
            False  # axolotl's key (its peft: section is LoftQ's, not NeMo's); no NeMo recipe has it
        )
    model = data.get("model")
    if NEMO_MARKERS & set(data) or (
        isinstance(model, Mapping) and ("_target_" in model or "torch_dtype" in model)
    ):
        return True
    return _has_target(data)


#: NeMo AutoModel YAML as a front end (see `mixprec.doctor.frontends.dispatch.FRONT_ENDS`).
FRONT_END = FrontEnd(
    name="nemo",
    claims=claims_nemo,
    read=facts_from_nemo,
    hint="a NeMo AutoModel recipe has 'model:', 'optimizer:', 'step_scheduler:'...",
    keys=NEMO_MARKERS | {"model", "optimizer", "distributed", "autocast", "fp8"},
)
