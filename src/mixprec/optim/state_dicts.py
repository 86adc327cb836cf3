"""State dicts of mixprec's optimizers: validation, migration in from torch, export out.

`to_native` turns what `RuleOptimizer.load_state_dict` is given into the optimizer's
own form, reporting what it converted:

* its own current form passes through unchanged;
* its own older forms (no ``maximize`` in a group, a ``step`` saved as a Python
  number or a float32 tensor) are upgraded;
* a state dict of the torch optimizer a rule replaces (`TORCH_FORMS`: groups
  without ``master``/``moments``) is converted: fp32 moments are encoded into the
  optimizer's moment formats (rounded to bf16 or quantized to int8 where those are
  chosen) and masters start equal to the parameters (torch keeps none). torch's SGD
  keeps no step count: a saved momentum buffer means the next step is not the
  first (``step`` 1), a parameter without one has no state.

`to_torch` goes the other way: moments decoded into the parameters' dtype, as
torch keeps them; masters cannot be expressed and are left out (export the
weights with `RuleOptimizer.master_weights` first when they matter). Lion has no
torch counterpart: its own state dicts round-trip, `to_torch` refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from mixprec.optim import sharding
from mixprec.optim.layout import flat_view, like_param
from mixprec.optim.rules import RULES, SQUARE

if TYPE_CHECKING:
    from mixprec.formats import MomentFormat
    from mixprec.optim.param_plan import ParamPlan

#: A parameter's plan (its rule and formats).
PlanOf = Callable[[torch.Tensor], "ParamPlan"]

__all__ = [
    "TORCH_FORMS",
    "StateConversion",
    "TorchForm",
    "check_param_state",
    "check_state_values",
    "is_torch_form",
    "param_state_from_torch",
    "param_state_to_torch",
    "read_state_dict",
    "step_tensor",
    "to_native",
    "to_torch",
]


@dataclass(frozen=True)
class TorchForm:
    """How the torch optimizer a rule replaces keeps its state dicts.

    Attributes:
        ours: the mixprec class whose own state dicts these rules' are (messages).
        torch_name: the torch optimizer (``None``: there is none; `to_torch` refuses).
        group_keys: keys every group of its state dicts has: how one is told from
            another optimizer's (RAdam's groups have no ``amsgrad``, SGD's no ``betas``).
        group_defaults: the value torch gives each group option when a saved group
            lacks it (an older torch): what an import reads and an export adds.
        keeps_step: whether its per-parameter state has a ``step`` (SGD's has none).
    """

    ours: str
    torch_name: str | None
    group_keys: tuple[str, ...] = ()
    group_defaults: Mapping[str, Any] = field(default_factory=dict)
    keeps_step: bool = True


_ADAM_DEFAULTS: Mapping[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_ADAMW = TorchForm(
    "mixprec.optim.AdamW",
    "torch.optim.AdamW",
    _ADAM_KEYS,
    {**_ADAM_DEFAULTS, "decoupled_weight_decay": True},
)
_ADAM = TorchForm(
    "mixprec.optim.Adam",
    "torch.optim.Adam",
    _ADAM_KEYS,
    {**_ADAM_DEFAULTS, "decoupled_weight_decay": False},
)
_SGD = TorchForm(
    "mixprec.optim.SGD",
    "torch.optim.SGD",
    ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    {"maximize": False, "foreach": None, "differentiable": False, "fused": None},
    keeps_step=False,
)

#: Each update rule's torch counterpart (`mixprec.optim.rules`): ``adamw`` is
#: `torch.optim.AdamW` (torch's Adam with ``decoupled_weight_decay=True`` saves the same).
TORCH_FORMS: Mapping[str, TorchForm] = {
    "adamw": _ADAMW,
    "adamw_amsgrad": _ADAMW,
    "adam": _ADAM,
    "adam_amsgrad": _ADAM,
    "sgd": _SGD,
    "sgd_momentum": _SGD,
    "sgd_nesterov": _SGD,
    "lion": TorchForm("mixprec.optim.Lion", None),
}


#: Every rule's moments of the ``square`` kind (never negative), by state key.
_SQUARE_KEYS = frozenset(key for r in RULES.values() for key, kind in r.slots if kind == SQUARE)

#: Group keys a saved state must agree on with the optimizer: they decide the formats.
GROUP_FORMAT_KEYS = ("master", "moments")


@dataclass(frozen=True, kw_only=True)
class StateConversion:
    """What loading a state dict converted (`RuleOptimizer.last_conversion`).

    Attributes:
        source: the torch optimizer converted from (``"torch.optim.SGD"``), or
            mixprec's (``"mixprec.optim.AdamW"``: nothing converted, or with
            ``" (older form)"``: upgraded).
        params: parameters whose saved state was converted.
        moments: moment format -> parameters whose fp32 moments were encoded into it.
        masters_from_params: parameters whose master starts equal to the parameter.
        notes: anything else that changed.
    """

    source: str
    params: int = 0
    moments: Mapping[str, int] = field(default_factory=dict)
    masters_from_params: int = 0
    notes: tuple[str, ...] = ()

    @property
    def converted(self) -> bool:
        """Whether anything was converted."""
        return bool(self.params or self.notes)

    def describe(self) -> str:
        """One line: what was converted into what."""
        if not self.converted:
            return f"loaded a {self.source} state dict as it is"
        parts = [f"loaded a {self.source} state dict, converting {self.params} parameter(s)"]
        for kind, count in sorted(self.moments.items()):
            parts.append(f"moments of {count} into {kind}")
        if self.masters_from_params:
            parts.append(f"{self.masters_from_params} master(s) started from the parameters")
        return "; ".join([*parts, *self.notes])


def check_state_values(key: str, src: torch.Tensor) -> None:
    """Refuse values no step could have written: they would reach the weights next step."""
    local = sharding.local(src)
    if local.device.type == "meta":
        raise ValueError(f"state {key!r} is a meta tensor (no data): load real tensors")
    if key == "step":
        value = float(local)
        if not (math.isfinite(value) and 0 <= value <= 2**53 and value.is_integer()):
            raise ValueError(f"state 'step' must be a whole number from 0 to 2**53, got {value!r}")
        return
    if not local.is_floating_point():
        return  # codes, remainders and seeds: every bit pattern is valid
    if not bool(torch.isfinite(local).all()):
        raise ValueError(f"state {key!r} holds inf/NaN: the checkpoint is corrupt")
    never_negative = key in _SQUARE_KEYS or key.endswith("_absmax")  # any rule's
    if never_negative and bool((local < 0).any()):
        raise ValueError(f"state {key!r} holds negative values: the checkpoint is corrupt")


def is_torch_form(groups: Sequence[Mapping[str, Any]]) -> bool:
    """Whether saved param groups come from `torch.optim.AdamW` (no ``master``/``moments``)."""
    return bool(groups) and all("master" not in g and "moments" not in g for g in groups)


def step_tensor(value: object, device: torch.device) -> torch.Tensor:
    """A saved step (a number, or a tensor of any float dtype) as this optimizer's float64."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"state 'step' must be one number, got shape {tuple(value.shape)}")
        value = float(value.item())
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"state 'step' must be a number, got {value!r}")
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def _moment(saved: Mapping[str, Any], key: str, p: torch.Tensor) -> torch.Tensor:
    value = saved.get(key)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(p.shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"torch state {key!r} of parameter {tuple(p.shape)} is {got}; expected a tensor "
            "shaped like the parameter"
        )
    if not value.is_floating_point():
        raise ValueError(f"torch state {key!r} is {value.dtype}; expected a float tensor")
    return value.detach().to(device=p.device, dtype=torch.float32)


def _form_of(
    param_groups: Sequence[dict[str, Any]], plan_of: PlanOf
) -> tuple[TorchForm, list[TorchForm]]:
    """The torch form of each group (by its rule: `TORCH_FORMS`), and the first one
    (a group without parameters takes it)."""
    found = [
        TORCH_FORMS[plan_of(group["params"][0]).rule.name] if group["params"] else None
        for group in param_groups
    ]
    first = next((f for f in found if f is not None), _ADAMW)
    return first, [f or first for f in found]


@torch.no_grad()
def param_state_from_torch(
    saved: Mapping[str, Any],
    p: torch.Tensor,
    plan: ParamPlan,
    fresh: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor] | None:
    """One parameter's torch state in this optimizer's rule and formats (None: no state).

    Args:
        saved: torch's state (``step`` where torch keeps one, and the rule's moments:
            ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``).
        p: the parameter (a plain tensor: convert before sharding).
        plan: the parameter's rule and formats here.
        fresh: this optimizer's freshly made state for `p` (shapes, dtypes, seeds).
    """
    slots, moments = plan.rule.slots, plan.moments
    form = TORCH_FORMS[plan.rule.name]
    keys = [key for key, _ in slots]
    if sharding.is_dtensor(p):
        raise ValueError(
            f"converting a {form.torch_name} state dict needs unsharded parameters: load it "
            "before fully_shard, then shard"
        )
    saved = {k: v for k, v in saved.items() if v is not None}  # torch SGD: buffer None
    allowed = ["step", *keys] if form.keeps_step else keys
    unknown = sorted(set(saved) - set(allowed))
    if unknown:
        raise ValueError(
            f"torch state holds keys {unknown} that {plan.rule.name} does not keep (only {allowed})"
        )
    if form.keeps_step:
        step = saved.get("step")
    elif not saved:
        return None  # torch made no buffer (no momentum, or never stepped): no state here
    else:
        step = 1  # torch keeps no count: a buffer means the next step is not the first
    shape = moments.kernel_shape(p.shape)
    # Encoded in the order the step walks the parameter (memory order), into tensors
    # made like the optimizer's own (same strides).
    values = [flat_view(like_param(_moment(saved, k, p), p.detach())).view(shape) for k in keys]
    encoded = moments.encode(values, plan.rule.kinds)
    out = dict(fresh)
    out["step"] = step_tensor(step, p.device)
    for key, value in zip(plan.moment_keys, encoded, strict=True):
        dst = torch.empty_like(fresh[key])
        if dst.shape == p.shape:
            flat_view(dst).copy_(value.reshape(-1))
        else:  # per-block scales
            dst.copy_(value.reshape(dst.shape))
        out[key] = dst
    out.update(plan.master.init_state(p.detach()))  # torch keeps no master: start at the param
    return out


@torch.no_grad()
def param_state_to_torch(
    state: Mapping[str, torch.Tensor],
    p: torch.Tensor,
    plan: ParamPlan,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """One parameter's state as the torch optimizer keeps it (moments in the param
    dtype, or in `dtype`; ``step`` where torch keeps one)."""
    moments: MomentFormat = plan.moments
    lp = sharding.local(p.detach())
    shape = moments.kernel_shape(lp.shape)
    local = {k: sharding.local(v) for k, v in state.items()}
    views = [
        flat_view(local[k]).view(shape) if local[k].shape == lp.shape else local[k].view(-1)
        for k in plan.moment_keys
    ]
    decoded = moments.decode(views, plan.rule.kinds)
    out: dict[str, torch.Tensor] = {}
    if TORCH_FORMS[plan.rule.name].keeps_step:
        out["step"] = torch.tensor(float(local["step"]), dtype=torch.float32)
    for (key, _), value in zip(plan.rule.slots, decoded, strict=True):
        dst = torch.empty_like(lp, dtype=dtype or p.dtype)  # the parameter's layout
        flat_view(dst).copy_(value.reshape(-1))
        out[key] = dst
    return out


def check_param_state(state: Mapping[str, torch.Tensor], saved: object) -> None:
    """Refuse a saved parameter state whose keys, shapes, dtypes or values do not fit `state`."""
    if not isinstance(saved, dict) or set(saved) != set(state):
        got = sorted(map(str, saved)) if isinstance(saved, dict) else repr(saved)
        raise ValueError(f"param state keys {got} do not match expected {sorted(state)}")
    for key, dst in state.items():
        src = cast(torch.Tensor, saved[key])
        ok = isinstance(src, torch.Tensor) and src.shape == dst.shape
        if not ok or src.dtype != dst.dtype:
            raise ValueError(
                f"state {key!r}: saved {getattr(src, 'dtype', type(src))} "
                f"{tuple(getattr(src, 'shape', ()))}, expected {dst.dtype} {tuple(dst.shape)}"
            )
        check_state_values(key, src)


def to_native(
    state_dict: dict[str, Any],
    param_groups: Sequence[dict[str, Any]],
    fresh_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    plan_of: PlanOf,
    check_group: Callable[[dict[str, Any], int], None] | None = None,
) -> tuple[dict[str, Any], StateConversion]:
    """`state_dict` in the optimizer's current form, and what was converted.

    Args:
        state_dict: what `RuleOptimizer.load_state_dict` was given.
        param_groups: the optimizer's groups.
        fresh_state: new state for a parameter (shapes, dtypes and seeds to fill).
        plan_of: a parameter's plan (rule and formats).
        check_group: checks a saved group against the optimizer's group of that index
            (a torch state dict's groups are checked before its state is converted).
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("an optimizer state dict needs 'state' and 'param_groups'")
    groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, list) or not isinstance(saved_state, dict):
        raise ValueError("'param_groups' must be a list and 'state' a dict")
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise ValueError(
                f"param group {i} of the state dict must be a mapping with a 'params' list, "
                f"got {type(group).__name__}"
            )
    if len(groups) != len(param_groups):
        raise ValueError(
            f"state dict has {len(groups)} param groups, optimizer has {len(param_groups)}"
        )
    first, forms = _form_of(param_groups, plan_of)
    if is_torch_form(groups):
        return _from_torch(
            groups, saved_state, param_groups, forms, fresh_state, plan_of, check_group
        )
    notes: list[str] = []
    new_groups = []
    for saved in groups:
        if "maximize" not in saved:
            saved = {**saved, "maximize": False}
            notes.append("groups without 'maximize' read as maximize=False")
        new_groups.append(saved)
    new_state: dict[Any, Any] = {}
    for pid, param_state in saved_state.items():
        step = param_state.get("step") if isinstance(param_state, dict) else None
        old_step = not (isinstance(step, torch.Tensor) and step.dtype == torch.float64)
        if step is not None and old_step:
            param_state = {**param_state, "step": step_tensor(step, torch.device("cpu"))}
            notes.append("'step' saved as a number or a float32 tensor read as float64")
        new_state[pid] = param_state
    source = f"{first.ours} (older form)" if notes else first.ours
    conversion = StateConversion(source=source, notes=tuple(dict.fromkeys(notes)))
    return {**state_dict, "state": new_state, "param_groups": new_groups}, conversion


def _group_from_torch(
    saved: dict[str, Any], ours: dict[str, Any], form: TorchForm, index: int
) -> dict[str, Any]:
    """A saved torch group as one of ours: the keys ours carry (a key torch's older
    groups lack read as torch reads it), our formats."""
    missing = ", ".join(map(repr, sorted(set(form.group_keys) - set(saved))))
    if form.torch_name is None:
        raise ValueError(
            f"group {index}: {form.ours} has no torch counterpart: another optimizer's state "
            f"cannot continue as {form.ours}"
        )
    if missing:
        raise ValueError(
            f"group {index}: not a {form.torch_name} state dict (its groups have no {missing}): "
            f"another optimizer's state cannot continue as {form.ours}"
        )
    new: dict[str, Any] = {k: saved[k] for k in ("params", "param_names") if k in saved}
    for key, value in ours.items():
        if key not in ("params", "param_names", "master", "moments"):
            new[key] = saved.get(key, form.group_defaults.get(key, value))
    if "decoupled_weight_decay" in ours and not saved.get("weight_decay"):
        # torch's decoupled_weight_decay changes nothing without weight decay (torch
        # Adam with weight_decay=0 is AdamW with it 0): read as ours.
        new["decoupled_weight_decay"] = ours["decoupled_weight_decay"]
    new.update(master=ours["master"], moments=ours["moments"])
    return new


def _from_torch(
    groups: list[dict[str, Any]],
    saved_state: dict[Any, Any],
    param_groups: Sequence[dict[str, Any]],
    forms: Sequence[TorchForm],
    fresh_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    plan_of: PlanOf,
    check_group: Callable[[dict[str, Any], int], None] | None,
) -> tuple[dict[str, Any], StateConversion]:
    new_groups = [
        _group_from_torch(saved, group, form, i)
        for i, (group, saved, form) in enumerate(zip(param_groups, groups, forms, strict=True))
    ]
    if check_group is not None:  # the groups first: a wrong rule is named as such
        _check_groups(param_groups, new_groups, check_group)
    new_state: dict[Any, Any] = {}
    moments: dict[str, int] = {}
    params = masters = 0
    for i, (group, saved) in enumerate(zip(param_groups, groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            continue  # the generic check names the mismatch
        for p, pid in zip(group["params"], saved["params"], strict=True):
            if pid not in saved_state:  # never stepped in torch: no state here either
                continue
            plan = plan_of(p)
            try:
                state = param_state_from_torch(saved_state[pid], p, plan, fresh_state(p))
            except ValueError as exc:
                raise ValueError(f"group {i}, parameter {tuple(p.shape)}: {exc}") from None
            if state is None:
                continue
            new_state[pid] = state
            params += 1
            name = plan.moments.spec.name
            moments[name] = moments.get(name, 0) + 1
            masters += bool(plan.master.spec.state)
    conversion = StateConversion(
        source=str(forms[0].torch_name),
        params=params,
        moments=moments,
        masters_from_params=masters,
    )
    return {"state": new_state, "param_groups": new_groups}, conversion


def to_torch(
    param_groups: Sequence[dict[str, Any]],
    state: Mapping[torch.Tensor, dict[str, torch.Tensor]],
    plan_of: PlanOf,
    moments_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The optimizer's state as the torch optimizer its rules replace saves it (see
    module docs); moments in `moments_dtype` when given, else in each parameter's dtype.

    Raises:
        ValueError: a rule has no torch counterpart (Lion).
    """
    groups: list[dict[str, Any]] = []
    out: dict[int, dict[str, torch.Tensor]] = {}
    index = 0
    for group, form in zip(param_groups, _form_of(param_groups, plan_of)[1], strict=True):
        if form.torch_name is None:
            raise ValueError(
                f"{form.ours} has no torch counterpart, so there is no torch state dict to "
                "give: save its own state_dict()"
            )
        saved = {k: v for k, v in group.items() if k not in ("params", "master", "moments")}
        for key, default in form.group_defaults.items():
            saved.setdefault(key, default)
        ids = []
        for p in group["params"]:
            if p in state and state[p] and float(state[p]["step"]) > 0:
                torch_state = param_state_to_torch(state[p], p, plan_of(p), moments_dtype)
                if torch_state:  # plain SGD: torch keeps no state
                    out[index] = torch_state
            ids.append(index)
            index += 1
        groups.append({**saved, "params": ids})
    return {"state": out, "param_groups": groups}


@dataclass(frozen=True)
class LoadedState:
    """A validated state dict, ready to replace an optimizer's state (`read_state_dict`).

    Attributes:
        states: each parameter's new state, or None for no state (never stepped).
        groups: the saved groups, in this optimizer's form.
        conversion: what was converted on the way.
    """

    states: dict[torch.Tensor, dict[str, torch.Tensor] | None]
    groups: list[dict[str, Any]]
    conversion: StateConversion


def _check_groups(
    param_groups: Sequence[dict[str, Any]],
    saved_groups: list[Any],
    check_group: Callable[[dict[str, Any], int], None],
) -> None:
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"state dict has {len(saved_groups)} param groups, optimizer has {len(param_groups)}"
        )
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups, strict=True)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                f"group {i}: state dict has {len(saved['params'])} params, "
                f"optimizer has {len(group['params'])}"
            )
        for key in GROUP_FORMAT_KEYS:
            if saved.get(key) != group[key]:
                raise ValueError(
                    f"group {i}: saved {key}={saved.get(key)!r} differs from "
                    f"this optimizer's {group[key]!r}: to convert, load it into an "
                    "optimizer of the saved formats, then that one's torch_state_dict() "
                    "and, with load_master_weights, its master_weights() into this one"
                )
        for key in ("maximize", "amsgrad", "capturable", "differentiable"):
            if key in saved and not isinstance(saved[key], bool):
                raise ValueError(f"group {i}: saved {key}={saved[key]!r} must be true or false")
        if saved.get("fused") is not None and not isinstance(saved["fused"], bool):
            raise ValueError(
                f"group {i}: saved fused={saved['fused']!r} must be true, false or null"
            )
        try:
            check_group({**saved, "betas": tuple(saved["betas"])} if "betas" in saved else saved, i)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"group {i}: saved hyperparameters are malformed: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"group {i}: saved {exc}") from exc


@torch.no_grad()
def read_state_dict(
    state_dict: dict[str, Any],
    param_groups: Sequence[dict[str, Any]],
    fresh_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    plan_of: PlanOf,
    check_group: Callable[[dict[str, Any], int], None],
) -> LoadedState:
    """Validate `state_dict` against the optimizer and build its new state, changing
    nothing: a bad entry anywhere raises before any state is replaced. `check_group`
    checks a saved group against the optimizer's group of that index.

    Raises:
        ValueError: groups, formats, state keys, shapes, dtypes or values do not fit.
    """
    native, conversion = to_native(state_dict, param_groups, fresh_state, plan_of, check_group)
    saved_groups, saved_state = native["param_groups"], native["state"]
    _check_groups(param_groups, saved_groups, check_group)
    pairs = [
        (p, saved_state.get(pid))
        for group, saved in zip(param_groups, saved_groups, strict=True)
        for p, pid in zip(group["params"], saved["params"], strict=True)
    ]
    named = {pid for saved in saved_groups for pid in saved["params"]}
    extra = sorted(map(str, set(saved_state) - named))
    if extra:
        raise ValueError(f"state dict holds state for parameters {extra} that no group names")
    states: dict[torch.Tensor, dict[str, torch.Tensor] | None] = {}
    for p, saved_p in pairs:
        if saved_p is None:
            states[p] = None
            continue
        new = fresh_state(p)
        check_param_state(new, saved_p)
        for key, dst in new.items():
            dst.copy_(saved_p[key])
        states[p] = new
    return LoadedState(states=states, groups=saved_groups, conversion=conversion)
