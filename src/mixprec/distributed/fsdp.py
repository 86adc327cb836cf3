"""`shard`: FSDP2 (`fully_shard`) per block and at the root, from a precision policy.

The `MixedPrecisionPolicy` of every group comes from the policy
(`mixed_precision_policy`): parameters are all-gathered and computed in the
compute dtype (``param_dtype``), gradients reduced in the policy's
``reduce_dtype`` (fp32 by default), the root's outputs cast to its
``output_dtype``, and floating inputs cast to the compute dtype
(``cast_forward_inputs``).

FSDP2 needs one parameter dtype per group and would cast every parameter of a
group to ``param_dtype``, so the modules the policy keeps in fp32 (its
``fp32_modules``, norms by default) become groups of their own that all-gather
and compute in fp32: fp32 islands survive sharding, under 16-bit storage and
under autocast policies alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from mixprec.distributed.launch import require_process_group
from mixprec.engine.plan import PrecisionPlan, resolve_plan
from mixprec.engine.storage import apply_storage
from mixprec.engine.wrappers import fsdp_modules, is_ddp
from mixprec.islands import IslandRule, is_fp32_island
from mixprec.policy import Policy, preset

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from mixprec.engine import Precision

__all__ = [
    "WrapArg",
    "block_modules",
    "mixed_precision_policy",
    "policy_of",
    "set_storage",
    "shard",
]

#: Which modules get an FSDP2 group of their own: a predicate on (qualified name,
#: module), or module classes; None: `block_modules`.
WrapArg = Callable[[str, nn.Module], bool] | Iterable[type[nn.Module]] | None


def policy_of(policy_arg: Policy | str | Precision) -> Policy:
    """The `Policy` of a policy, a preset name, or a `Precision`."""
    from mixprec.engine import Precision

    if isinstance(policy_arg, Precision):
        return policy_arg.policy
    return preset(policy_arg)


def mixed_precision_policy(
    policy_arg: Policy | str | Precision, *, island: bool = False, root: bool = True
) -> MixedPrecisionPolicy:
    """FSDP2's `MixedPrecisionPolicy` for a group under `policy_arg`.

    Args:
        policy_arg: a `Policy`, a preset name, or a `Precision`.
        island: the group of an fp32 module: all-gathered and computed in fp32
            (its own forward hooks upcast its inputs), gradients reduced in the
            policy's ``reduce_dtype``.
        root: the root group, which alone casts outputs to ``output_dtype``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    pol = policy_of(policy_arg)
    compute = None if island else pol.compute_dtype
    return MixedPrecisionPolicy(
        param_dtype=compute,
        reduce_dtype=pol.reduce_dtype,
        output_dtype=pol.output_dtype if root and not island else None,
        cast_forward_inputs=compute is not None,
    )


def set_storage(model: nn.Module, pol: Policy, *, wrapper: str) -> PrecisionPlan:
    """Set `pol`'s storage on an unwrapped `model` before `wrapper` wraps it (as
    `Precision.prepare` does); returns the plan.

    Raises:
        ValueError: `model` is already wrapped by FSDP2 or DDP.
    """
    if is_ddp(model) or fsdp_modules(model):
        raise ValueError(
            f"{wrapper}() takes an unwrapped model, but this one is already wrapped by "
            f"{'DistributedDataParallel' if is_ddp(model) else 'fully_shard'}; pass the "
            "model before wrapping it"
        )
    plan = resolve_plan(pol)
    first = next(iter(model.parameters()), None)
    apply_storage(model, plan, first.device.type if first is not None else "cpu")
    return plan


def block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The default blocks to shard one by one: the entries of every `nn.ModuleList`
    that hold parameters (a transformer's layers), as torchtitan wraps them."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for index, child in enumerate(module):
                if any(True for _ in child.parameters()):
                    found.append((f"{name}.{index}" if name else str(index), child))
    return found


def _selected(model: nn.Module, wrap: WrapArg) -> list[tuple[str, nn.Module]]:
    if wrap is None:
        return block_modules(model)
    if callable(wrap) and not isinstance(wrap, type):
        return [(n, m) for n, m in model.named_modules() if n and wrap(n, m)]
    classes = tuple(wrap)  # type: ignore[arg-type]
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"wrap must be a predicate (name, module) -> bool or module classes, got {wrap!r}"
        )
    return [(n, m) for n, m in model.named_modules() if n and isinstance(m, classes)]


def _has_params(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def shard(
    model: nn.Module,
    policy_arg: Policy | str | Precision,
    *,
    mesh: DeviceMesh | None = None,
    wrap: WrapArg = None,
    reshard_after_forward: bool | int = True,
) -> nn.Module:
    """Shard `model` with FSDP2 under `policy_arg` (see the module docs).

    The policy's storage is set first (fp32 islands, 16-bit parameters), as
    `Precision.prepare` does, then `fully_shard` is applied bottom-up: to each fp32
    island, to each block (`wrap`), and to the root. Call it on every rank, after
    ``torch.distributed.init_process_group``.

    Args:
        model: the model, unwrapped, on the device it trains on.
        policy_arg: a `Policy`, a preset name, or a `Precision`.
        mesh: the data-parallel `DeviceMesh` (default: every rank, as `fully_shard`).
        wrap: the blocks that get groups of their own (see `WrapArg`).
        reshard_after_forward: passed to `fully_shard`.

    Returns:
        The same model, sharded in place (its parameters are `DTensor`s).

    Raises:
        ValueError: `model` is already wrapped by FSDP2 or DDP.
    """
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        require_process_group("mixprec.distributed.shard")
    pol = policy_of(policy_arg)
    plan = set_storage(model, pol, wrapper="shard")
    rule = IslandRule(plan.islands.entries, active=True)
    islands = {
        id(m): (n, m)
        for n, m in model.named_modules()
        if n and (is_fp32_island(m) or (pol.compute_dtype is not None and rule.matches(n, m)))
    }
    blocks = [(n, m) for n, m in _selected(model, wrap) if id(m) not in islands]
    groups = [(n, m, True) for n, m in islands.values()] + [(n, m, False) for n, m in blocks]
    groups = [g for g in groups if _has_params(g[1])]
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    for _, module, island in sorted(groups, key=lambda g: -g[0].count(".")):  # deepest first
        fully_shard(
            module, mp_policy=mixed_precision_policy(pol, island=island, root=False), **kwargs
        )
    root_island = is_fp32_island(model)
    fully_shard(model, mp_policy=mixed_precision_policy(pol, island=root_island), **kwargs)
    return model
