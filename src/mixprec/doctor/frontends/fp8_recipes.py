"""The fp8 scaling recipes the ecosystem's configs name, read and checked without torch.

Spellings (each as its framework reads it):

* torchao float8 (``Float8LinearConfig.from_recipe_name``): ``tensorwise``,
  ``rowwise``, ``rowwise_with_gw_hp``; torchao asserts the name is one of them.
* Transformer Engine ``DelayedScaling`` (``transformer_engine.common.recipe``):
  ``fp8_format`` ``HYBRID`` (e4m3 forward, e5m2 backward), ``E4M3`` or ``E5M2``;
  ``amax_history_len``; ``amax_compute_algo`` ``max`` or ``most_recent``;
  ``margin`` (the scale is divided by ``2**margin``).
* Megatron Core / NeMo (``TransformerConfig``): ``fp8`` ``hybrid`` or ``e4m3``
  (NeMo 1.x: ``fp8: true`` with ``fp8_e4m3``/``fp8_hybrid``; NeMo raises "fp8
  enabled but fp8_format (fp8_e4m3 | fp8_hybrid) is not set" with neither),
  ``fp8_recipe`` ``delayed`` (Megatron Core's default), ``tensorwise``, ``mxfp8``,
  ``blockwise``, ``fp8_amax_history_len``, ``fp8_amax_compute_algo``, ``fp8_margin``.

Every recipe here scales; `describe_te_delayed` and `megatron_fp8` return the
words `TrainingFacts.fp8_scaling` holds, and unknown values raise `ValueError`
naming the valid ones (the framework refuses them too).
"""

from __future__ import annotations

from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.values import config_int, config_value

__all__ = [
    "AMAX_ALGOS",
    "MEGATRON_RECIPES",
    "TE_FORMATS",
    "TORCHAO_RECIPES",
    "check_choice",
    "describe_te_delayed",
    "megatron_fp8",
]

#: torchao's float8 recipe names (``Float8LinearRecipeName``).
TORCHAO_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

#: Transformer Engine's ``recipe.Format`` names.
TE_FORMATS: tuple[str, ...] = ("HYBRID", "E4M3", "E5M2")

#: Transformer Engine's ``amax_compute_algo`` choices.
AMAX_ALGOS: tuple[str, ...] = ("max", "most_recent")

#: Megatron Core's ``fp8_recipe`` choices (``megatron/core/enums.py`` ``Fp8Recipe``).
MEGATRON_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "mxfp8", "blockwise")


def check_choice(doc: ConfigDoc, key: str, value: object, valid: tuple[str, ...]) -> str:
    """`value` as one of `valid` (compared case-insensitively, returned as spelled in
    `valid`), else `ValueError` naming the key, its line and the valid values."""
    word = str(value).strip()
    for choice in valid:
        if word.lower() == choice.lower():
            return choice
    raise ValueError(f"{doc.loc(key)}: unknown value {value!r}; valid: {', '.join(valid)}")


def describe_te_delayed(
    *, fp8_format: str | None, history: int | None, algo: str | None, margin: int | None
) -> str:
    """``Transformer Engine DelayedScaling (HYBRID, amax_history_len 1024, ...)``: the
    settings that were given."""
    parts = [fp8_format] if fp8_format else []
    if history is not None:
        parts.append(f"amax_history_len {history}")
    if algo is not None:
        parts.append(f"amax_compute_algo {algo}")
    if margin is not None:
        parts.append(f"margin {margin}")
    return "Transformer Engine DelayedScaling" + (f" ({', '.join(parts)})" if parts else "")


def megatron_fp8(doc: ConfigDoc, prefix: str) -> tuple[str, str] | None:
    """The Megatron Core / NeMo fp8 settings under `prefix` (``"model."``): None when fp8
    is off, else ``(scaling, detail)``.

    Raises:
        ValueError: an unknown ``fp8``/``fp8_recipe``/``fp8_amax_compute_algo``, a
            negative margin or a history below 1, or NeMo 1.x's ``fp8: true``
            without ``fp8_e4m3``/``fp8_hybrid``.
    """
    key = f"{prefix}fp8"
    raw = config_value(doc, key, (bool, str), "hybrid, e4m3, true or false")
    if (
        raw is None
        or raw is False
        or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null", "false", "no"))
    ):
        return None
    if raw is True:  # NeMo 1.x: the format comes from two flags
        if doc.get(f"{prefix}fp8_e4m3") is True:
            fmt = "E4M3"
        elif doc.get(f"{prefix}fp8_hybrid") is True:
            fmt = "HYBRID"
        else:
            raise ValueError(
                f"{doc.loc(key)}: fp8 is true but neither {prefix}fp8_e4m3 nor "
                f"{prefix}fp8_hybrid is: NeMo raises 'fp8 enabled but fp8_format (fp8_e4m3 | "
                "fp8_hybrid) is not set'; set fp8_hybrid: true (e4m3 forward, e5m2 backward)"
            )
    else:
        fmt = check_choice(doc, key, raw, ("HYBRID", "E4M3"))
    recipe_key = f"{prefix}fp8_recipe"
    raw_recipe = config_value(doc, recipe_key, (str,), "a recipe name (delayed, tensorwise...)")
    recipe = (
        "delayed"
        if raw_recipe is None
        else check_choice(doc, recipe_key, raw_recipe, MEGATRON_RECIPES)
    )
    detail = f"{key}: {raw} ({fmt}), fp8_recipe {recipe}"
    if recipe != "delayed":
        return f"Megatron Core fp8_recipe {recipe} ({fmt})", detail
    history = config_int(doc, f"{prefix}fp8_amax_history_len")
    if history is not None and history < 1:
        raise ValueError(f"{doc.loc(prefix + 'fp8_amax_history_len')}: must be >= 1, got {history}")
    margin = config_int(doc, f"{prefix}fp8_margin")
    if margin is not None and margin < 0:
        raise ValueError(f"{doc.loc(prefix + 'fp8_margin')}: must be >= 0, got {margin}")
    raw_algo = config_value(doc, f"{prefix}fp8_amax_compute_algo", (str,), "max or most_recent")
    algo = (
        None
        if raw_algo is None
        else check_choice(doc, f"{prefix}fp8_amax_compute_algo", raw_algo, AMAX_ALGOS)
    )
    return describe_te_delayed(fp8_format=fmt, history=history, algo=algo, margin=margin), detail
