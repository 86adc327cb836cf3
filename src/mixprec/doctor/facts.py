"""The precision facts of a training setup, whatever front end they came from.

The config front ends (mixprec YAML, NeMo AutoModel YAML) and the live-object
front end all reduce what they read to one `TrainingFacts` record; the static
rules (`mixprec.doctor.rules`) are pure functions of it. A fact the front end
could not learn is None, and rules that need it stay silent.

Facts are plain data: formats are held by their canonical names (``"bf16"``,
`mixprec.floats`), so reading a config and judging it never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mixprec.floats import canonical_name
from mixprec.formats.registry import auto_master, master_specs

if TYPE_CHECKING:  # the static path never loads torch, the device probe or the engine
    from mixprec.device import DeviceCaps
    from mixprec.engine.wrappers import Reduction

__all__ = [
    "FULL_PRECISION_MASTERS",
    "Dialect",
    "GroupFacts",
    "OptimizerFacts",
    "TrainingFacts",
    "resolve_mixprec_master",
]

#: How the facts were described; rules word their fixes in the user's own terms.
Dialect = Literal[
    "mixprec",
    "nemo",
    "live",
    "hf",
    "deepspeed",
    "accelerate",
    "axolotl",
    "torchtitan",
    "lightning",
    "litgpt",
]

#: Master representations that keep updates below the parameter's half-ulp (from the
#: format registry: exact, 24-bit, compensated or stochastic ones).
FULL_PRECISION_MASTERS: frozenset[str] = frozenset(
    spec.name for spec in master_specs() if spec.keeps_small_updates
)


def resolve_mixprec_master(requested: str, dtype: object) -> str:
    """The master `mixprec.optim.AdamW` uses for a `dtype` parameter (a `torch.dtype` or
    a name) when a config asks for `requested` (``auto`` resolved by the registry's rule)."""
    return requested if requested != "auto" else auto_master(dtype)


@dataclass(frozen=True, kw_only=True)
class GroupFacts:
    """What an optimizer keeps for one group of parameters.

    Attributes:
        param_dtype: storage dtype of the group's (trainable) parameters, by
            canonical name (``"bf16"``).
        master: how full precision is kept for them: ``none``, ``fp32``,
            ``exact``, ``remainder8``, ``kahan``, ``stochastic``, or ``fp16`` (a
            16-bit master with a scale factor, as Transformer Engine offers).
        moments: storage of the moments: ``fp32``, ``bf16``, ``fp16``, ``fp8``,
            ``int8``, ``int4``, or ``none`` (a stateless optimizer).
        numel: number of parameter elements, or None when unknown (configs).
        label: a short name for the group (``"group 0"``).
    """

    param_dtype: str
    master: str
    moments: str
    numel: int | None = None
    label: str = "all parameters"

    def __post_init__(self) -> None:
        _name_dtypes(self, "param_dtype")


@dataclass(frozen=True, kw_only=True)
class OptimizerFacts:
    """The optimizer of a setup.

    Attributes:
        name: its class or ``_target_`` (``"torch.optim.AdamW"``).
        state: the state it keeps beside each parameter, by state key
            (``("exp_avg", "exp_avg_sq")`` for Adam, ``("momentum_buffer",)`` for SGD
            with momentum, ``()`` for plain SGD, which keeps none); None when the
            optimizer is not recognised: the optimizer-state rule then judges nothing.
        groups: what it keeps per parameter group.
        note: how master/moments were determined, when not obvious.
    """

    name: str
    state: tuple[str, ...] | None
    groups: tuple[GroupFacts, ...]
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class TrainingFacts:
    """Every precision fact of one training setup the static rules look at.

    Attributes:
        source: the file path, or ``"live objects"``.
        dialect: how the setup was described (fixes use its spelling).
        param_dtype: storage dtype of the trainable parameters, by canonical name
            (``"bf16"``; every dtype here is one), None if unknown.
        param_dtype_note: how `param_dtype` was decided when it was not stated
            (e.g. NeMo's ``torch_dtype: auto`` taken as bf16).
        compute_dtype: the dtype matmuls effectively run in (autocast/FSDP2
            compute dtype, else the storage dtype), None if unknown.
        loss_scaling: whether the loss is scaled; None if unknown.
        compute_changed_by: on the target device, what the trainer does instead of the
            compute format the config asks for (`requested_compute_dtype`), e.g. the HF
            Trainer's ``fp16: true`` on a CPU, which runs without autocast; else empty.
        requested_compute_dtype: the compute format the config asks for, when the
            trainer runs another on the target device (`compute_changed_by`).
        unscaled_acknowledged: fp16 without scaling was explicitly allowed.
        optimizer: the optimizer, None if unknown.
        reduce_dtype: dtype of cross-rank gradient reduction, None if unknown (a
            wrapped live model: the 16-bit dtype if any group reduces in one).
        reduce_note: how `reduce_dtype` was decided when it was not stated.
        policy_reduce_dtype: the reduce dtype the policy asks for, when a wrapped
            live model's `reductions` decide `reduce_dtype`; else None.
        reductions: what a live model's data-parallel wrappers do, per FSDP2 group
            or DDP gradient dtype (`mixprec.engine.wrappers.reductions`); empty for
            configs and unwrapped models.
        norms_fp32: whether norm layers keep fp32 storage/compute; None if unknown
            or not applicable.
        norm_detail: names of norm modules/parameters found in 16 bits.
        loss_fp32: whether the loss is computed from fp32 logits; None if unknown.
        fp8_enabled: fp8 compute or storage is in use.
        fp8_scaling: the fp8 scaling recipe, None when there is none.
        fp8_detail: how fp8 is used (for the evidence).
        fp8_emulated: the config asks for emulated fp8 matmuls (torchao ``emulate``).
        fp8_emulated_by: the key that asks for it (``"fp8.emulate: true"``).
        peft: only adapters train (LoRA/PEFT).
        steps: planned optimizer steps, None if unknown.
        unknown: values the config leaves to the run (``"recipe.yaml:4
            model.torch_dtype: ${DTYPE}"``): the facts they feed are None, never guessed.
        loss_scaling_off_by: the config key that turned off loss scaling its preset
            had (``"precision.loss_scaling: null"``), else empty.
        device: capabilities of the device the run targets, None if unknown.
        where: fact name to its location (``"run.yaml:12 optimizer._target_"``).
    """

    source: str
    dialect: Dialect
    param_dtype: str | None = None
    param_dtype_note: str = ""
    compute_dtype: str | None = None
    loss_scaling: bool | None = None
    compute_changed_by: str = ""
    requested_compute_dtype: str | None = None
    unscaled_acknowledged: bool = False
    optimizer: OptimizerFacts | None = None
    reduce_dtype: str | None = None
    reduce_note: str = ""
    policy_reduce_dtype: str | None = None
    reductions: tuple[Reduction, ...] = ()
    norms_fp32: bool | None = None
    norm_detail: tuple[str, ...] = ()
    loss_fp32: bool | None = None
    fp8_enabled: bool = False
    fp8_scaling: str | None = None
    fp8_detail: str = ""
    fp8_emulated: bool = False
    fp8_emulated_by: str = ""
    peft: bool = False
    steps: int | None = None
    unknown: tuple[str, ...] = ()
    loss_scaling_off_by: str = ""
    device: DeviceCaps | None = None
    where: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _name_dtypes(
            self,
            "param_dtype",
            "compute_dtype",
            "requested_compute_dtype",
            "reduce_dtype",
            "policy_reduce_dtype",
        )

    def locate(self, *facts: str) -> str:
        """The location of the first of `facts` that has one, else the source."""
        for fact in facts:
            if fact in self.where:
                return self.where[fact]
        return self.source


def _name_dtypes(facts: object, *fields: str) -> None:
    """Hold each dtype field by its canonical name (a `torch.dtype` or any spelling is
    accepted); an unknown one raises `ValueError`."""
    for name in fields:
        value = getattr(facts, name)
        if value is not None:
            object.__setattr__(facts, name, canonical_name(value))
