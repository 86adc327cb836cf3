"""What other tools' optimizer classes keep, read from a config's ``_target_`` entry.

Shared by the config front ends: torch.optim's optimizers (the Adam family, SGD,
Adagrad, RMSprop, Muon, Adafactor, ...), Lion (lion-pytorch, bitsandbytes),
Transformer Engine's ``FusedAdam``, flashoptim, torchao and torch-optimi AdamW
variants and ``mixprec.optim``'s ``AdamW``, ``Adam``, ``SGD`` and ``Lion`` are
recognised by their dotted names (allowlists below; nothing is imported), and their
keyword arguments are read into `OptimizerFacts`: what state they keep per
parameter (`OptimizerFacts.state`), their master and their moment format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixprec.doctor.facts import GroupFacts, OptimizerFacts, resolve_mixprec_master
from mixprec.doctor.frontends.document import ConfigDoc
from mixprec.doctor.frontends.nemo_values import UnknownValueError, Unresolved
from mixprec.doctor.frontends.values import config_int, config_str, describe
from mixprec.floats import canonical_name, is_16bit_name
from mixprec.formats.registry import DEFAULT_MASTER, DEFAULT_MOMENTS

__all__ = [
    "FLASHOPTIM_TARGETS",
    "LION_TARGETS",
    "MIXPREC_TARGETS",
    "OPTIMI_TARGETS",
    "TE_FUSED_ADAM_TARGETS",
    "TORCHAO_TARGETS",
    "TORCH_STATE",
    "TORCH_TARGETS",
    "config_bool",
    "config_dtype",
    "mixprec_state",
    "optimizer_facts",
    "state_format",
    "torch_optimizer_facts",
    "torch_state",
]

#: torch.optim optimizers by class name, with the state each keeps per parameter under
#: its default options (`torch_state` adds what options turn on). All keep it in the
#: parameters' dtype and have no master.
TORCH_STATE: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg", "exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "NAdam": ("exp_avg", "exp_avg_sq"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
    "Adamax": ("exp_avg", "exp_inf"),
    "SparseAdam": ("exp_avg", "exp_avg_sq"),
    "SGD": (),
    "Adagrad": ("sum",),
    "RMSprop": ("square_avg",),
    "Adadelta": ("square_avg", "acc_delta"),
    "Muon": ("momentum_buffer",),
    "Adafactor": ("row_var", "col_var"),
}
#: Their dotted names as configs spell them (``torch.optim.SGD``, ``torch.optim.sgd.SGD``).
TORCH_TARGETS: dict[str, str] = {
    **{f"torch.optim.{cls}": cls for cls in TORCH_STATE},
    **{f"torch.optim.{cls.lower()}.{cls}": cls for cls in TORCH_STATE},
}
#: Lion implementations outside mixprec, with the format of their one momentum
#: (``param``: the parameters' dtype); none keeps a master.
LION_TARGETS: dict[str, str] = {
    "lion_pytorch.Lion": "param",
    "lion_pytorch.lion_pytorch.Lion": "param",
    "bitsandbytes.optim.Lion": "fp32",
    "bitsandbytes.optim.Lion32bit": "fp32",
    "bitsandbytes.optim.PagedLion": "fp32",
    "bitsandbytes.optim.PagedLion32bit": "fp32",
    "bitsandbytes.optim.Lion8bit": "int8",
    "bitsandbytes.optim.PagedLion8bit": "int8",
}
#: Transformer Engine's fused Adam.
TE_FUSED_ADAM_TARGETS: frozenset[str] = frozenset(
    {
        "transformer_engine.pytorch.optimizers.FusedAdam",
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
    }
)
#: flashoptim's AdamW (``master_weight_bits`` 24 or 32, quantized moments).
FLASHOPTIM_TARGETS: frozenset[str] = frozenset({"flashoptim.FlashAdamW", "flashoptim.FlashAdam"})
#: torchao's low-bit AdamW variants, with the moment format of each.
TORCHAO_TARGETS: dict[str, str] = {
    "torchao.optim.AdamW8bit": "int8",
    "torchao.optim.AdamW4bit": "int4",
    "torchao.optim.AdamWFp8": "fp8",
    "torchao.optim.AdamW": "param",
}
#: torch-optimi optimizers (Kahan summation for 16-bit params by default).
OPTIMI_TARGETS: frozenset[str] = frozenset({"optimi.AdamW", "optimi.Adam", "optimi.StableAdamW"})
#: mixprec's own optimizers by dotted name: the class, whose options decide its rule.
MIXPREC_TARGETS: dict[str, str] = {
    f"mixprec.optim.{cls}": cls for cls in ("AdamW", "Adam", "SGD", "Lion")
}

_ADAM = ("exp_avg", "exp_avg_sq")

_PRECISION_RANK = {"fp32": 3, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0}


def torch_state(cls: str, options: Mapping[str, Any]) -> tuple[str, ...]:
    """The state torch.optim's `cls` keeps per parameter with `options` (its keyword
    arguments; absent ones take torch's defaults)."""
    state = TORCH_STATE[cls]
    if cls == "SGD" and _positive(options.get("momentum")):
        state = ("momentum_buffer",)
    if cls in ("Adam", "AdamW") and options.get("amsgrad") is True:
        state = (*state, "max_exp_avg_sq")
    if cls == "RMSprop":
        state += ("momentum_buffer",) if _positive(options.get("momentum")) else ()
        state += ("grad_avg",) if options.get("centered") is True else ()
    return state


def mixprec_state(cls: str, options: Mapping[str, Any]) -> tuple[str, ...]:
    """The moments `mixprec.optim`'s `cls` keeps per parameter with `options`: the slots
    of the rule the options pick (`mixprec.optim.rules.RULES`; a test pins the two)."""
    if cls == "SGD":
        return ("momentum_buffer",) if _positive(options.get("momentum")) else ()
    if cls == "Lion":
        return ("exp_avg",)
    amsgrad = ("max_exp_avg_sq",) if options.get("amsgrad") is True else ()
    return ("exp_avg", "exp_avg_sq", *amsgrad)


def _positive(value: Any) -> bool:
    """A momentum turned on (a number above zero; a value left to the run counts as on)."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, int | float):
        return value > 0
    if isinstance(value, str):
        try:
            return float(value) > 0
        except ValueError:
            return True
    return True


def torch_optimizer_facts(
    target: str, storage: str, options: Mapping[str, Any], *, label: str = "all parameters"
) -> OptimizerFacts | None:
    """What a torch.optim optimizer (`TORCH_TARGETS`) or another library's Lion
    (`LION_TARGETS`) keeps for parameters stored in `storage`: no master, its state in
    the parameters' dtype (a Lion's in its own format); None for any other name."""
    if target in TORCH_TARGETS:
        state = torch_state(TORCH_TARGETS[target], options)
        moments = storage if state else "none"
        note = "torch.optim keeps its state in the parameters' dtype and has no master"
    elif target in LION_TARGETS:
        state = ("exp_avg",)
        kept = LION_TARGETS[target]
        moments = storage if kept == "param" else kept
        note = f"{target} keeps its momentum in {moments} and has no master"
    else:
        return None
    group = GroupFacts(param_dtype=storage, master="none", moments=moments, label=label)
    return OptimizerFacts(name=target, state=state, groups=(group,), note=note)


def config_dtype(doc: ConfigDoc, path: str, value: Any) -> str | None:
    """A dtype from a config value; None for null. ValueError names the key;
    `UnknownValueError` for a value left to the run's environment (NeMo ``${VAR}``)."""
    if isinstance(value, Unresolved):
        raise UnknownValueError(path)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    if not isinstance(value, str):
        raise ValueError(f"{doc.loc(path)}: must be a dtype name, got {describe(value)}")
    try:
        return canonical_name(str(value))
    except ValueError as exc:
        raise ValueError(f"{doc.loc(path)}: {exc}") from exc


def state_format(doc: ConfigDoc, path: str, value: Any) -> str:
    """A TE optimizer-state dtype as a format name (torch.uint8 means fp8)."""
    if isinstance(value, str) and value.strip().lower().removeprefix("torch.") == "uint8":
        return "fp8"
    dt = config_dtype(doc, path, value)
    return "fp32" if dt is None else dt


def config_bool(doc: ConfigDoc, path: str, value: Any, default: bool) -> bool:
    """A boolean config value (``true``/``false`` strings too); ValueError names the key;
    `UnknownValueError` for a value left to the run's environment (NeMo ``${VAR}``)."""
    if isinstance(value, Unresolved):
        raise UnknownValueError(path)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{doc.loc(path)}: must be true or false, got {value!r}")


def optimizer_facts(
    doc: ConfigDoc, storage: str, *, path: str = "optimizer"
) -> OptimizerFacts | None:
    """What the optimizer named at `path` (a ``_target_`` or ``name`` + ``kwargs``
    section) keeps for parameters stored in `storage`; None when it is not on an allowlist."""
    section = doc.mapping(path)
    if section is None:
        return None
    key = f"{path}._target_" if "_target_" in section else f"{path}.name"
    target = config_str(doc, key, "a dotted class name")
    if target is None:
        return None
    target = target.strip()
    nested = isinstance(section.get("kwargs"), Mapping)
    kw: Mapping[str, Any] = section["kwargs"] if nested else section
    prefix = f"{path}.kwargs." if nested else f"{path}."
    param = storage

    def group(master: str, moments: str) -> tuple[GroupFacts, ...]:
        return (GroupFacts(param_dtype=storage, master=master, moments=moments),)

    plain = torch_optimizer_facts(target, storage, kw)
    if plain is not None:
        return plain
    if target in TE_FUSED_ADAM_TARGETS:
        master_on = config_bool(doc, prefix + "master_weights", kw.get("master_weights"), False)
        master = "none"
        if master_on:
            mdt = config_dtype(doc, prefix + "master_weight_dtype", kw.get("master_weight_dtype"))
            remainders = config_bool(
                doc, prefix + "store_param_remainders", kw.get("store_param_remainders"), False
            )
            if mdt is not None and mdt != "fp32":
                master = mdt
            elif remainders and storage == "bf16":
                master = "exact"  # bf16 param + 16-bit remainder reconstructs fp32 bitwise
            else:
                master = "fp32"
        formats = [
            state_format(doc, prefix + key, kw.get(key))
            for key in ("exp_avg_dtype", "exp_avg_sq_dtype")
        ]
        moments = min(formats, key=lambda f: _PRECISION_RANK.get(f, 3))
        return OptimizerFacts(
            name=target,
            state=_ADAM,
            groups=group(master, moments),
            note=f"master_weights={master_on}, exp_avg/exp_avg_sq in {'/'.join(formats)}",
        )
    if target in FLASHOPTIM_TARGETS:
        bits = config_int(doc, prefix + "master_weight_bits", "24, 32 or null")
        if "master_weight_bits" not in kw:
            bits = 24
        master = {24: "remainder8", 32: "exact"}.get(bits, "none") if bits is not None else "none"
        quantize = config_bool(doc, prefix + "quantize", kw.get("quantize"), True)
        return OptimizerFacts(
            name=target,
            state=_ADAM,
            groups=group(master, "int8" if quantize else param),
            note=f"master_weight_bits={bits}",
        )
    if target in TORCHAO_TARGETS:
        sr = config_bool(
            doc, prefix + "bf16_stochastic_round", kw.get("bf16_stochastic_round"), False
        )
        moments = TORCHAO_TARGETS[target]
        return OptimizerFacts(
            name=target,
            state=_ADAM,
            groups=group("stochastic" if sr else "none", param if moments == "param" else moments),
        )
    if target in OPTIMI_TARGETS:
        kahan = kw.get("kahan_sum")
        on = (
            is_16bit_name(storage)
            if kahan is None
            else config_bool(doc, prefix + "kahan_sum", kahan, True)
        )
        return OptimizerFacts(
            name=target,
            state=_ADAM,
            groups=group("kahan" if on else "none", param),
            note="kahan_sum defaults to on for 16-bit parameters" if kahan is None else "",
        )
    if target in MIXPREC_TARGETS:
        cls = MIXPREC_TARGETS[target]
        state = mixprec_state(cls, kw)
        named_master = config_str(doc, prefix + "master", "a master name (exact, fp32...)")
        named_moments = config_str(doc, prefix + "moments", "a format (fp32, bf16, int8)")
        if "master" not in kw:
            named_master = DEFAULT_MASTER
        if "moments" not in kw:
            named_moments = DEFAULT_MOMENTS
        if named_master is None or named_moments is None:
            return OptimizerFacts(
                name=target,
                state=state,
                groups=(),
                note=f"master/moments not stated and mixprec.optim.{cls}'s defaults unknown",
            )
        resolved = resolve_mixprec_master(named_master, storage)
        return OptimizerFacts(
            name=target, state=state, groups=group(resolved, named_moments if state else "none")
        )
    return None  # not on an allowlist: not judged
