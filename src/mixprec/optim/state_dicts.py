"""State dicts of `mixprec.optim.AdamW`: validation, migration in from torch, export out.

`to_native` turns what `AdamW.load_state_dict` is given into this optimizer's
own form, reporting what it converted:

* its own current form passes through unchanged;
* its own older forms (no ``maximize`` in a group, a ``step`` saved as a Python
  number or a float32 tensor) are upgraded;
* a `torch.optim.AdamW` state dict (groups without ``master``/``moments``) is
  converted: fp32 moments are encoded into the optimizer's moment formats
  (rounded to bf16 or quantized to int8 where those are chosen) and masters
  start equal to the parameters (torch keeps none).

`to_torch` goes the other way: moments decoded into the parameters' dtype, as
torch keeps them; masters cannot be expressed and are left out (export the
weights with `AdamW.master_weights` first when they matter).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from mixprec.optim import sharding
from mixprec.optim.layout import flat_view, like_param

if TYPE_CHECKING:
    from mixprec.formats import MomentFormat
    from mixprec.optim.param_plan import ParamPlan

#: A parameter's plan (its rule and formats).
PlanOf = Callable[[torch.Tensor], "ParamPlan"]

__all__ = [
    "TORCH_GROUP_DEFAULTS",
    "StateConversion",
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

#: The group options `torch.optim.AdamW` stores that mixprec's groups do not carry
#: (with the values mixprec's behaviour corresponds to).
TORCH_GROUP_DEFAULTS: Mapping[str, Any] = {
    "amsgrad": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


#: Group keys a saved state must agree on with the optimizer: they decide the formats.
GROUP_FORMAT_KEYS = ("master", "moments")


@dataclass(frozen=True, kw_only=True)
class StateConversion:
    """What loading a state dict converted (`AdamW.last_conversion`).

    Attributes:
        source: ``"torch.optim.AdamW"``, ``"mixprec.optim.AdamW (older form)"``
            or ``"mixprec.optim.AdamW"`` (nothing converted).
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
    if key in ("exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax") and bool((local < 0).any()):
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


@torch.no_grad()
def param_state_from_torch(
    saved: Mapping[str, Any],
    p: torch.Tensor,
    plan: ParamPlan,
    fresh: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One parameter's torch state in this optimizer's rule and formats.

    Args:
        saved: torch's state (``step`` and the rule's moments: ``exp_avg``, ``exp_avg_sq``).
        p: the parameter (a plain tensor: convert before sharding).
        plan: the parameter's rule and formats here.
        fresh: this optimizer's freshly made state for `p` (shapes, dtypes, seeds).
    """
    slots, moments = plan.rule.slots, plan.moments
    keys = [key for key, _ in slots]
    if sharding.is_dtensor(p):
        raise ValueError(
            "converting a torch.optim.AdamW state dict needs unsharded parameters: load it "
            "before fully_shard, then shard"
        )
    unknown = sorted(set(saved) - {"step", *keys})
    if unknown:
        raise ValueError(
            f"torch state holds keys {unknown} that {plan.rule.name} does not keep (only "
            f"{['step', *keys]})"
        )
    shape = moments.kernel_shape(p.numel())
    # Encoded in the order the step walks the parameter (memory order), into tensors
    # made like the optimizer's own (same strides).
    values = [flat_view(like_param(_moment(saved, k, p), p.detach())).view(shape) for k in keys]
    encoded = moments.encode(values, plan.rule.kinds)
    out = dict(fresh)
    out["step"] = step_tensor(saved.get("step"), p.device)
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
    dtype, or in `dtype`)."""
    moments: MomentFormat = plan.moments
    lp = sharding.local(p.detach())
    shape = moments.kernel_shape(lp.numel())
    local = {k: sharding.local(v) for k, v in state.items()}
    views = [
        flat_view(local[k]).view(shape) if local[k].shape == lp.shape else local[k].view(-1)
        for k in plan.moment_keys
    ]
    decoded = moments.decode(views, plan.rule.kinds)
    out = {"step": torch.tensor(float(local["step"]), dtype=torch.float32)}
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
) -> tuple[dict[str, Any], StateConversion]:
    """`state_dict` in the optimizer's current form, and what was converted.

    Args:
        state_dict: what `AdamW.load_state_dict` was given.
        param_groups: the optimizer's groups.
        fresh_state: new state for a parameter (shapes, dtypes and seeds to fill).
        plan_of: a parameter's plan (rule and formats).
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
    if is_torch_form(groups):
        return _from_torch(groups, saved_state, param_groups, fresh_state, plan_of)
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
    source = "mixprec.optim.AdamW (older form)" if notes else "mixprec.optim.AdamW"
    conversion = StateConversion(source=source, notes=tuple(dict.fromkeys(notes)))
    return {**state_dict, "state": new_state, "param_groups": new_groups}, conversion


def _from_torch(
    groups: list[dict[str, Any]],
    saved_state: dict[Any, Any],
    param_groups: Sequence[dict[str, Any]],
    fresh_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    plan_of: PlanOf,
) -> tuple[dict[str, Any], StateConversion]:
    new_groups: list[dict[str, Any]] = []
    new_state: dict[Any, Any] = {}
    moments: dict[str, int] = {}
    params = masters = 0
    for i, (group, saved) in enumerate(zip(param_groups, groups, strict=True)):
        if "amsgrad" not in saved:  # torch's Adam and AdamW groups carry it; RAdam, NAdam... not
            raise ValueError(
                f"group {i}: not a torch.optim.AdamW (or Adam) state dict (its groups have no "
                "'amsgrad'): another optimizer's state cannot continue as AdamW"
            )
        l2_decay = saved.get("decoupled_weight_decay") is False and saved.get("weight_decay")
        if l2_decay:  # torch Adam with weight_decay=0 is AdamW with it 0: fine
            raise ValueError(
                f"group {i}: the state dict is torch Adam with L2 weight decay "
                "(decoupled_weight_decay=False), not AdamW; it cannot continue here"
            )
        new_group = {k: v for k, v in saved.items() if k not in ("fused", "decoupled_weight_decay")}
        new_group.update(master=group["master"], moments=group["moments"])
        new_group.setdefault("maximize", False)
        new_groups.append(new_group)
        if len(saved.get("params", ())) != len(group["params"]):
            continue  # the generic check names the mismatch
        for p, pid in zip(group["params"], saved["params"], strict=True):
            if pid not in saved_state:  # never stepped in torch: no state here either
                continue
            fresh = fresh_state(p)
            plan = plan_of(p)
            try:
                new_state[pid] = param_state_from_torch(saved_state[pid], p, plan, fresh)
            except ValueError as exc:
                raise ValueError(f"group {i}, parameter {tuple(p.shape)}: {exc}") from None
            params += 1
            name = plan.moments.spec.name
            moments[name] = moments.get(name, 0) + 1
            masters += bool(plan.master.spec.state)
    conversion = StateConversion(
        source="torch.optim.AdamW",
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
    """The optimizer's state as `torch.optim.AdamW` saves it (see module docs);
    moments in `moments_dtype` when given, else in each parameter's dtype."""
    groups: list[dict[str, Any]] = []
    out: dict[int, dict[str, torch.Tensor]] = {}
    index = 0
    for group in param_groups:
        saved = {k: v for k, v in group.items() if k not in ("params", "master", "moments")}
        for key, default in TORCH_GROUP_DEFAULTS.items():
            saved.setdefault(key, default)
        ids = []
        for p in group["params"]:
            if p in state and state[p] and float(state[p]["step"]) > 0:
                out[index] = param_state_to_torch(state[p], p, plan_of(p), moments_dtype)
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
                    f"this optimizer's {group[key]!r}"
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
    native, conversion = to_native(state_dict, param_groups, fresh_state, plan_of)
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
