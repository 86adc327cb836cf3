"""The doctor on live objects: a policy, a model, an optimizer, a scaler, a device.

`check` reads what the objects really hold (parameter dtypes, each optimizer
group's master and moment format, whether the scaler is enabled, and for a model
wrapped by FSDP2 or DDP what its wrappers communicate, from
`mixprec.engine.wrappers.reductions`) into `TrainingFacts` and runs the static
rules on them. Any subset of the objects
may be given; rules whose facts are missing stay silent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mixprec.doctor.facts import (
    GroupFacts,
    OptimizerFacts,
    TrainingFacts,
    resolve_mixprec_master,
)
from mixprec.doctor.findings import Finding, sort_findings
from mixprec.doctor.frontends.frontend import DeviceArg, resolve_device
from mixprec.doctor.frontends.optimizers import LION_TARGETS, TORCH_STATE, torch_state
from mixprec.doctor.rules import run_static_rules
from mixprec.dtypes import dtype_name, is_16bit, is_fp8
from mixprec.engine import Precision
from mixprec.engine.optimizers import unwrapped
from mixprec.engine.wrappers import Reduction, reductions
from mixprec.islands import is_norm_layer
from mixprec.policy import Policy, preset

__all__ = [
    "PEFT_MAX_TRAINABLE_FRACTION",
    "check",
    "facts_from_objects",
    "optimizer_facts",
]

#: A model whose trainable share of parameter elements is at most this, with the rest
#: frozen, is taken as adapter (PEFT/LoRA) training.
PEFT_MAX_TRAINABLE_FRACTION = 0.1

_ADAM = ("exp_avg", "exp_avg_sq")


def _dominant_dtype(params: Iterable[torch.Tensor]) -> torch.dtype | None:
    counts: Counter[torch.dtype] = Counter()
    for p in params:
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


def _format(dtype: torch.dtype | Any) -> str:
    if isinstance(dtype, torch.dtype):
        return "fp8" if dtype == torch.uint8 or is_fp8(dtype) else dtype_name(dtype)
    return str(dtype)


def _class_name(obj: object) -> str:
    mod, cls = type(obj).__module__, type(obj).__name__
    if mod.startswith("torch.optim."):
        return f"torch.optim.{cls}"
    if mod.startswith("mixprec.optim"):
        return f"mixprec.optim.{cls}"
    return f"{mod}.{cls}"


def _split_by_dtype(
    label: str, params: list[torch.Tensor], master_of: Any, moments_of: Any
) -> list[GroupFacts]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.is_floating_point() and p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    out = []
    for dt, ps in by_dtype.items():
        name = label if len(by_dtype) == 1 else f"{label} ({dtype_name(dt)})"
        out.append(
            GroupFacts(
                param_dtype=dtype_name(dt),
                master=master_of(dt, ps),
                moments=moments_of(dt, ps),
                numel=sum(p.numel() for p in ps),
                label=name,
            )
        )
    return out


def optimizer_facts(optimizer: torch.optim.Optimizer) -> OptimizerFacts:
    """What `optimizer` keeps per parameter group (state, master, moment format).

    Recognizes `mixprec.optim` optimizers (each group's rule, ``master`` and
    ``moments``), ``mixprec.optim.Mastered`` (its master around an unmodified torch
    optimizer, whose state is fp32), torch.optim's optimizers (no master, state in the
    parameters' dtype, read from the state once a step made it), Lion from lion-pytorch
    and bitsandbytes, Transformer Engine's FusedAdam, torch-optimi (Kahan summation) and
    torchao's AdamW variants by their module and attributes, without importing them.
    Any other optimizer is not judged (`OptimizerFacts.state` None).
    """
    optimizer = unwrapped(optimizer)  # Accelerate's AcceleratedOptimizer: judge what it holds
    mod, cls = type(optimizer).__module__, type(optimizer).__name__
    name = _class_name(optimizer)
    groups: list[GroupFacts] = []
    state: tuple[str, ...] | None = _ADAM
    note = ""
    inner = getattr(optimizer, "inner", None) if cls == "Mastered" else None
    if mod.startswith("mixprec.optim") and isinstance(inner, torch.optim.Optimizer):
        return _mastered_facts(optimizer, inner)
    # lion-pytorch's and bitsandbytes' Lion, by the names their packages export
    lion = LION_TARGETS.get(
        f"{mod.split('.')[0]}.optim.{cls}", LION_TARGETS.get(f"{mod.split('.')[0]}.{cls}")
    )
    for i, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        label = f"group {i}"
        if mod.startswith("mixprec.optim"):
            rule_of = getattr(optimizer, "rule_of", None)  # the rule decides the moments
            slots = tuple(k for k, _ in rule_of(group).slots) if rule_of is not None else _ADAM
            state = slots if i == 0 else tuple(dict.fromkeys((*(state or ()), *slots)))
            master = str(group.get("master", "none"))
            moments = str(group.get("moments", "fp32")) if slots else "none"
            format_of = getattr(optimizer, "format_of", None)

            def mixprec_master(
                dt: torch.dtype, ps: list[torch.Tensor], m: str = master, f: Any = format_of
            ) -> str:
                # The optimizer's own answer where it has one: fp32 parameters (islands)
                # in a group with a 16-bit master are their own master.
                return str(f(ps[0])[0]) if f is not None else resolve_mixprec_master(m, dt)

            groups += _split_by_dtype(label, params, mixprec_master, lambda dt, ps, m=moments: m)
        elif mod.startswith("transformer_engine") and cls == "FusedAdam":
            on = bool(getattr(optimizer, "master_weights", False))
            mdt = getattr(optimizer, "master_weight_dtype", torch.float32)
            rem = bool(getattr(optimizer, "store_param_remainders", False))
            formats = [
                _format(getattr(optimizer, a, torch.float32))
                for a in ("exp_avg_dtype", "exp_avg_sq_dtype")
            ]
            moments = next((f for f in formats if f != "fp32"), "fp32")

            def te_master(dt: torch.dtype, on: bool = on, mdt: Any = mdt, rem: bool = rem) -> str:
                if not on:
                    return "none"
                if mdt != torch.float32:
                    return _format(mdt)
                return "exact" if rem and dt == torch.bfloat16 else "fp32"

            groups += _split_by_dtype(
                label, params, lambda dt, ps: te_master(dt), lambda dt, ps, m=moments: m
            )
        elif mod.startswith("optimi"):
            kahan = group.get("kahan_sum")
            groups += _split_by_dtype(
                label,
                params,
                # optimi applies Kahan summation to 16-bit parameters only
                lambda dt, ps, k=kahan: "kahan" if is_16bit(dt) and k is not False else "none",
                lambda dt, ps: dtype_name(dt),
            )
        elif mod.startswith("torchao.optim"):
            sr = bool(group.get("bf16_stochastic_round", False))
            groups += _split_by_dtype(
                label,
                params,
                lambda dt, ps, s=sr: "stochastic" if s else "none",
                lambda dt, ps: (
                    "int8" if "8bit" in cls else "int4" if "4bit" in cls else dtype_name(dt)
                ),
            )
        elif lion is not None:
            state = ("exp_avg",)
            kept = "the parameters' dtype" if lion == "param" else lion
            note = f"{name} keeps its momentum in {kept} and has no master"
            groups += _split_by_dtype(
                label,
                params,
                lambda dt, ps: "none",
                lambda dt, ps, k=lion: dtype_name(dt) if k == "param" else k,
            )
        elif mod.startswith("torch.optim") and cls in TORCH_STATE:
            note = "torch.optim keeps its state in the parameters' dtype and has no master"
            keys = torch_state(cls, group)
            state = keys if i == 0 else tuple(dict.fromkeys((*(state or ()), *keys)))

            def state_dtype(dt: torch.dtype, ps: list[torch.Tensor], k: Any = keys) -> str:
                if not k:
                    return "none"
                for p in ps:
                    for value in optimizer.state.get(p, {}).values():
                        if isinstance(value, torch.Tensor) and value.dim() > 0:
                            return dtype_name(value.dtype)
                return dtype_name(dt)

            groups += _split_by_dtype(label, params, lambda dt, ps: "none", state_dtype)
        else:
            state = None
            groups += _split_by_dtype(label, params, lambda dt, ps: "none", lambda dt, ps: "none")
    return OptimizerFacts(name=name, state=state, groups=tuple(groups), note=note)


def _mastered_facts(
    optimizer: torch.optim.Optimizer, inner: torch.optim.Optimizer
) -> OptimizerFacts:
    """``mixprec.optim.Mastered``: each group's master over its 16-bit parameters (fp32
    ones are their own), the inner torch optimizer's state in fp32 (it steps fp32
    shadows)."""
    inner_cls = type(inner).__name__
    known = type(inner).__module__.startswith("torch.optim") and inner_cls in TORCH_STATE
    state: tuple[str, ...] | None = None
    if known:
        state = tuple(
            dict.fromkeys(k for g in inner.param_groups for k in torch_state(inner_cls, g))
        )
    groups: list[GroupFacts] = []
    for i, group in enumerate(optimizer.param_groups):
        master = str(group.get("master", "none"))
        groups += _split_by_dtype(
            f"group {i}",
            list(group["params"]),
            lambda dt, ps, m=master: (
                "none" if dt == torch.float32 else resolve_mixprec_master(m, dt)
            ),
            lambda dt, ps: "fp32" if state != () else "none",
        )
    return OptimizerFacts(
        name=f"mixprec.optim.Mastered({_class_name(inner)})",
        state=state if state is not None else (),
        groups=tuple(groups),
        note="Mastered steps an unmodified torch optimizer on fp32 values decoded from the master",
    )


def _wrapper_facts(found: list[Reduction]) -> tuple[torch.dtype | None, str, str]:
    """The reduce dtype a wrapped model really uses (a 16-bit one if any group with
    gradients reduces in one), how it was read, and where."""
    live = [r for r in found if r.numel and r.reduce_dtype is not None]
    half = [r for r in live if r.reduce_dtype is not None and is_16bit(r.reduce_dtype)]
    chosen = half or live
    dtype = chosen[0].reduce_dtype if chosen else None
    if found[0].wrapper == "ddp":
        hooked = all(r.mixed_precision_policy for r in found)
        where = "model: DistributedDataParallel" + (
            " (mixprec's reduction hook)" if hooked else " (no mixprec reduction hook)"
        )
        note = "read from the DDP module: " + (
            "mixprec's hook reduces in the dtype it records"
            if hooked
            else "without a hook DDP reduces gradients in their own dtype"
        )
        return dtype, note, where
    first = chosen[0] if chosen else found[0]
    name = "root" if first.module == "" else repr(first.module)
    note = f"read from the model's {len(found)} fully_shard groups' MixedPrecisionPolicy" + (
        f" ({len(half)} reduce in {dtype_name(dtype)})" if half else ""
    )
    return dtype, note, f"model: fully_shard group {name}"


def facts_from_objects(
    *,
    policy: Policy | str | Precision | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    device: DeviceArg = None,
    steps: int | None = None,
    peft: bool | None = None,
) -> TrainingFacts:
    """The `TrainingFacts` of live objects (see `check` for the arguments).

    Raises:
        ValueError: for `steps` that is not an integer >= 1.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1 (planned optimizer steps), got {steps!r}")
    pol: Policy | None = None
    if policy is not None:
        pol = _resolve_policy(policy, device)
    caps = resolve_device(device)
    where: dict[str, str] = {}

    trainable: list[torch.Tensor] = []
    total = 0
    if model is not None:
        for p in model.parameters():
            total += p.numel()
            if p.requires_grad:
                trainable.append(p)
    elif optimizer is not None:
        trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    param_dtype = _dominant_dtype(trainable) or (pol.param_dtype if pol else None)
    if trainable:
        where["param_dtype"] = "model parameters" if model is not None else "optimizer parameters"

    if peft is None:
        n_train = sum(p.numel() for p in trainable)
        peft = (
            model is not None
            and 0 < n_train < total
            and n_train <= PEFT_MAX_TRAINABLE_FRACTION * total
        )

    compute: torch.dtype | None = pol.effective_compute_dtype if pol else param_dtype
    if pol is not None:
        where["compute_dtype"] = f"policy {pol.name!r}"
    elif param_dtype is not None:
        where["compute_dtype"] = "model parameters (no policy given: no autocast assumed)"

    loss_scaling: bool | None = None
    if scaler is not None:
        loss_scaling = bool(scaler.is_enabled()) or bool(pol and pol.scales_loss)
        where["loss_scaling"] = f"scaler ({type(scaler).__name__}, enabled={scaler.is_enabled()})"
    elif pol is not None:
        loss_scaling = pol.scales_loss
        where["loss_scaling"] = f"policy {pol.name!r}"

    opt_facts: OptimizerFacts | None = None
    if optimizer is not None:
        opt_facts = optimizer_facts(optimizer)
        where["optimizer"] = where["master"] = f"optimizer {opt_facts.name}"
    elif pol is not None:
        half = [p for p in trainable if p.dtype != torch.float32]
        groups = [
            GroupFacts(
                param_dtype=dtype_name(
                    pol.param_dtype if not trainable else (_dominant_dtype(half) or pol.param_dtype)
                ),
                master=pol.master,
                moments=pol.moments,
                numel=sum(p.numel() for p in half) if trainable else None,
                label="16-bit parameters" if trainable else "all parameters",
            )
        ]
        if trainable and not half:
            groups = [
                GroupFacts(
                    param_dtype="fp32",
                    master="none",
                    moments=pol.moments,
                    numel=sum(p.numel() for p in trainable),
                )
            ]
        opt_facts = OptimizerFacts(
            name="mixprec.optim.AdamW",
            state=_ADAM,
            groups=tuple(groups),
            note=f"as Precision({pol.name!r}).optimizer(model) would build it",
        )
        where["optimizer"] = where["master"] = f"policy {pol.name!r} (optimizer it implies)"

    norms_fp32: bool | None = None
    norm_detail: list[str] = []
    fp8_params: list[str] = []
    if model is not None:
        seen_norm = False
        for mname, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
            if is_norm_layer(module) and own:
                seen_norm = True
                if any(is_16bit(p.dtype) for p in own):
                    norm_detail.append(f"{mname or '<model>'} ({type(module).__name__})")
            fp8_params += [
                f"{mname}.{n}" for n, p in module.named_parameters(recurse=False) if is_fp8(p.dtype)
            ]
        if seen_norm:
            norms_fp32 = not norm_detail
        if norm_detail:
            where["norms"] = norm_detail[0]
        if fp8_params:
            where["fp8"] = fp8_params[0]

    fp8_scaling: str | None = None
    fp8_detail = f"{len(fp8_params)} parameters stored in fp8 with no scale" if fp8_params else ""
    fp8_emulated = False
    if model is not None and not fp8_params:
        from mixprec.doctor.runtime.fp8_layers import fp8_layers

        layers = fp8_layers(model)
        if layers:
            recipes = sorted({la.recipe for la in layers})
            fp8_scaling = f"torchao float8 {', '.join(recipes)} (current scaling)"
            fp8_detail = f"{len(layers)} torchao Float8Linear layer(s)"
            emulated = [la.name for la in layers if la.emulate]
            fp8_emulated = bool(emulated)
            where["fp8"] = f"model: {layers[0].name}"
            if emulated:
                where["fp8_emulated"] = f"model: {emulated[0]} (Float8LinearConfig(emulate=True))"

    if fp8_scaling is None and not fp8_params and pol is not None and pol.fp8 is not None:
        # The policy's FP8 layers, before (or without) a model prepared under it.
        fp8_scaling = f"torchao float8 {pol.fp8.recipe} (current scaling)"
        fp8_detail = f"policy {pol.name!r} fp8 {pol.fp8.recipe!r}"
        fp8_emulated = pol.fp8.emulate is True
        where["fp8"] = f"policy {pol.name!r} (fp8)"
        if fp8_emulated:
            where["fp8_emulated"] = f"policy {pol.name!r} (fp8 emulate=True)"

    reduce_dtype = pol.reduce_dtype if pol else None
    reduce_note = ""
    found = reductions(model) if model is not None else []
    if found:
        reduce_dtype, reduce_note, where["reduce_dtype"] = _wrapper_facts(found)
        where["wrappers"] = where["reduce_dtype"]
        plain = [r for r in found if r.wrapper == "fsdp2" and not r.mixed_precision_policy]
        if plain:
            name = "root" if plain[0].module == "" else repr(plain[0].module)
            where["wrappers"] = f"model: fully_shard group {name} (default MixedPrecisionPolicy)"
    elif pol is not None:
        where["reduce_dtype"] = f"policy {pol.name!r}"
    if caps is not None:
        where["device"] = f"device {caps.name}"
    return TrainingFacts(
        source="live objects",
        dialect="live",
        param_dtype=_name(param_dtype),
        compute_dtype=_name(compute),
        loss_scaling=loss_scaling,
        unscaled_acknowledged=bool(pol and pol.allow_unscaled),
        optimizer=opt_facts,
        reduce_dtype=_name(reduce_dtype),
        reduce_note=reduce_note,
        policy_reduce_dtype=_name(pol.reduce_dtype) if pol is not None and found else None,
        reductions=tuple(found),
        norms_fp32=norms_fp32,
        norm_detail=tuple(norm_detail),
        fp8_enabled=bool(fp8_params) or fp8_scaling is not None,
        fp8_scaling=fp8_scaling,
        fp8_detail=fp8_detail,
        fp8_emulated=fp8_emulated,
        fp8_emulated_by=(
            ("Float8LinearConfig(emulate=True)" if model is not None else "fp8 emulate=True")
            if fp8_emulated
            else ""
        ),
        peft=bool(peft),
        steps=steps,
        device=caps,
        where=where,
    )


def _resolve_policy(value: Policy | str | Precision, device: DeviceArg) -> Policy:
    if isinstance(value, Precision):
        return value.policy
    if isinstance(value, Policy):
        return value
    if isinstance(device, torch.device | str):
        return preset(value, device=device)
    return preset(value)


def check(
    *,
    policy: Policy | str | Precision | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    device: DeviceArg = None,
    steps: int | None = None,
    peft: bool | None = None,
) -> list[Finding]:
    """Check live training objects before a run; any subset may be given.

    Args:
        policy: the `Policy` (a preset name, or a `Precision`'s) the run uses:
            compute dtype, loss scaling, reduce dtype; without an `optimizer`, also
            the master and moments of the `mixprec.optim.AdamW` it implies.
        model: the model as it will train (after `Precision.prepare`): parameter
            storage dtypes, norm layers, trainable share; wrapped by FSDP2
            (`fully_shard`) or DDP, what its wrappers really communicate (the
            reduce dtype then comes from them, not from the policy).
        optimizer: the optimizer: its master and moment format per group.
        scaler: a `torch.amp.GradScaler`; enabled means the loss is scaled.
        device: the device the run targets (judges ``format-not-accelerated``).
        steps: planned optimizer steps, at least 1 (a short run softens
            ``optimizer-state-16bit``); None when unknown.
        peft: only adapters train; by default inferred from the model (at most
            `PEFT_MAX_TRAINABLE_FRACTION` of the elements trainable, the rest frozen).

    Returns:
        The findings, errors first. Example: ``torch.optim.AdamW`` over a bf16
        model gives ``optimizer-state-16bit``.
    """
    facts = facts_from_objects(
        policy=policy,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        device=device,
        steps=steps,
        peft=peft,
    )
    return sort_findings(run_static_rules(facts))


def _name(dtype: torch.dtype | None) -> str | None:
    """A fact's dtype: the canonical name, None when unknown."""
    return dtype_name(dtype) if dtype is not None else None
