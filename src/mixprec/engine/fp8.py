"""FP8 linear layers: what `Precision.prepare` does with a policy's `Float8Training`.

The eligible `nn.Linear` layers of a model are swapped for torchao's
``Float8Linear`` by torchao's own ``convert_to_float8_training`` (config
``Float8LinearConfig.from_recipe_name(recipe)`` with ``emulate`` set), after the
storage dtypes and fp32 islands are in place; nothing else in the model changes.
The new modules hold the very `nn.Parameter` objects of the old ones, so an
optimizer built before or after (`Precision.optimizer`, `mixprec.optim.AdamW` with
its exact master) keeps the same parameters, and ``state_dict`` keys stay those of
`nn.Linear` (``weight``, ``bias``): checkpoints interchange with the 16-bit model.

Which layers convert (`fp8_layer_choice`), in this order of reasons to keep one in
16 bits: a layer inside an fp32 island; a subclass of `nn.Linear` (its forward is
its own); the first and the last `nn.Linear` of ``model.named_modules()`` (with
``skip_first_last``); an ``exclude`` pattern; in or out features not divisible by
``min_divisor``. Layers that are already ``Float8Linear`` (a second `prepare`)
stay converted. The outcome is a `Float8Conversion` (`Precision.fp8`): the recipe,
whether the GEMMs are emulated and why, the converted layers and each kept layer
with its reason. A model where no layer qualifies trains entirely in 16 bits, with
a `PrecisionWarning`.

torchao's ``Float8Linear`` casts its input to the autocast dtype only under CUDA
autocast; on other devices a bf16 layer under autocast could then meet an fp32
input (and ``rowwise_with_gw_hp``'s high-precision grad_weight GEMM fails on the
mixed dtypes). Each converted layer gets a forward pre-hook (`AutocastInput`) that
does the same cast on every device, so the three recipes run alike everywhere.

torchao is imported here, lazily, on the first conversion: without it the FP8
presets are still plain data (listable, comparable), but `prepare` raises
`ImportError` with the install line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.errors import PrecisionError, PrecisionWarning, user_stacklevel
from mixprec.policy import Float8Training

__all__ = [
    "INSTALL_LINE",
    "AutocastInput",
    "Float8Conversion",
    "KeptLayer",
    "convert_fp8_linears",
    "float8_linear_config",
    "fp8_hardware",
    "fp8_layer_choice",
    "is_float8_linear",
    "load_torchao_float8",
    "refuse_float8_layers",
    "refuse_other_float8_config",
]

#: How to install what FP8 training needs.
INSTALL_LINE = "pip install 'mixprec[fp8]' (or pip install 'torchao>=0.10')"

# The smallest CUDA capability with FP8 tensor cores (Ada Lovelace sm_89, Hopper sm_90).
_FP8_CAPABILITY = (8, 9)

_HOOK_ATTR = "_mixprec_autocast_input"  # on a converted layer: the pre-hook's id

# torchao's import logs (through its and torch's loggers) that its CUDA extensions
# cannot load on a CPU build and that an enum is registered the old way: neither
# matters to float8 training, whose emulation and torch._scaled_mm need no extension.
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


# ------------------------------------------------------------------ torchao


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def load_torchao_float8(what: str = "FP8 training") -> Any:
    """torchao's ``torchao.float8`` module, imported on first use.

    Raises:
        ImportError: torchao is not installed (or too old to have float8 training),
            with the install line.
    """
    try:
        with _quiet_import():
            import torchao.float8 as float8

            float8.Float8LinearConfig.from_recipe_name  # noqa: B018 - torchao >= 0.10
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"{what} runs on torchao's float8 training, which is not available "
            f"({type(exc).__name__}: {exc}); install it: {INSTALL_LINE}"
        ) from exc
    return float8


def float8_linear_config(settings: Float8Training, *, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for `settings`: the recipe's, with `emulate`."""
    float8 = load_torchao_float8(f"fp8 recipe {settings.recipe!r}")
    config = float8.Float8LinearConfig.from_recipe_name(settings.recipe)
    return dataclasses.replace(config, emulate=emulate)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether `module` is torchao's ``Float8Linear`` (known by class name: no import)."""
    return any(
        cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")
        for cls in type(module).__mro__
    )


# ------------------------------------------------------------------ hardware


def fp8_hardware(device: torch.device | str) -> tuple[bool, str]:
    """Whether `device` has FP8 GEMM units (CUDA capability 8.9 or more), and why, in
    one sentence."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return False, f"{dev.type} has no FP8 GEMM units: torchao emulates them"
    if not torch.cuda.is_available():
        return False, "CUDA is not available here"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) >= _FP8_CAPABILITY:
        return True, f"sm_{major}{minor} has FP8 tensor cores"
    return False, f"sm_{major}{minor} predates FP8 tensor cores (sm_89+)"


def _resolve_emulate(
    settings: Float8Training, device: torch.device, policy: str
) -> tuple[bool, str]:
    fast, why = fp8_hardware(device)
    if settings.emulate is None:
        return (not fast), f"auto: {why}"
    if settings.emulate:
        return True, "emulate=True: numerics only, no FP8 speed"
    if not fast:
        raise PrecisionError(
            f"policy {policy!r} asks for real FP8 GEMMs (fp8 emulate=False), which "
            f"{device} cannot run: {why}; fix: emulate=None (auto) or True"
        )
    return False, f"emulate=False: {why}"


# ------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class KeptLayer:
    """An `nn.Linear` left in 16 bits, and why.

    Attributes:
        name: its qualified name in the model (``""``: the model itself).
        reason: one phrase (``"first nn.Linear (skip_first_last)"``).
    """

    name: str
    reason: str


def _in_island(name: str, islands: tuple[str, ...]) -> str | None:
    for island in islands:
        if island == "" or name == island or name.startswith(island + "."):
            return island
    return None


def fp8_layer_choice(
    model: nn.Module, settings: Float8Training, *, islands: tuple[str, ...] = ()
) -> tuple[list[tuple[str, nn.Linear]], list[KeptLayer]]:
    """The `nn.Linear` layers of `model` that convert under `settings`, and those kept.

    Args:
        model: the model (not changed).
        settings: the policy's `Float8Training`.
        islands: qualified names of the fp32 islands (their layers stay as they are).

    Returns:
        ``(convert, kept)``: the layers to convert (or already converted), with their
        names, in ``named_modules`` order; each kept layer with its reason.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    names: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, nn.Linear):
            names.setdefault(id(m), []).append(n)
    ends: dict[str, str] = {}
    if settings.skip_first_last and linears:
        ends[linears[-1][0]] = "last nn.Linear (skip_first_last)"
        ends[linears[0][0]] = "first nn.Linear (skip_first_last)"
        if len(linears) == 1:
            ends[linears[0][0]] = "the only nn.Linear (skip_first_last)"
    convert: list[tuple[str, nn.Linear]] = []
    kept: list[KeptLayer] = []
    divisor = settings.min_divisor
    for name, module in linears:
        island = _in_island(name, islands)
        pattern = settings.excludes(name)
        reason: str | None
        shared = names[id(module)]
        if is_float8_linear(module):
            reason = None  # converted by an earlier prepare: it stays so
        elif len(shared) > 1:
            reason = (
                f"one module under {len(shared)} names ({', '.join(shared)}): converting "
                "one name would leave the others in 16 bits"
            )
        elif island is not None:
            reason = f"inside fp32 island {island or '<model>'!r}"
        elif type(module) is not nn.Linear:
            reason = f"{type(module).__name__} is an nn.Linear subclass (its forward is its own)"
        elif name in ends:
            reason = ends[name]
        elif pattern is not None:
            reason = f"excluded by {pattern!r}"
        elif module.in_features % divisor or module.out_features % divisor:
            reason = (
                f"in/out features {module.in_features}/{module.out_features} not both "
                f"divisible by {divisor}"
            )
        else:
            reason = None
        if reason is None:
            convert.append((name, module))
        else:
            kept.append(KeptLayer(name, reason))
    return convert, kept


# ------------------------------------------------------------------ the input cast


class AutocastInput:
    """Forward pre-hook of a converted layer: floating inputs to the autocast dtype of
    their device while autocast is on there (what ``Float8Linear`` does under CUDA
    autocast only). Stateless and picklable: `copy.deepcopy` and ``torch.save`` of
    the model keep it."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        device_type = x.device.type
        if not (x.is_floating_point() and torch.is_autocast_enabled(device_type)):
            return None
        dtype = torch.get_autocast_dtype(device_type)
        if x.dtype == dtype:
            return None
        return (x.to(dtype), *args[1:])


def _add_input_cast(module: nn.Module) -> None:
    if getattr(module, _HOOK_ATTR, None) is not None:
        return
    handle = module.register_forward_pre_hook(AutocastInput())
    setattr(module, _HOOK_ATTR, handle.id)


# ------------------------------------------------------------------ conversion


@dataclass(frozen=True)
class Float8Conversion:
    """What `Precision.prepare` did with a policy's FP8 settings (`Precision.fp8`).

    Attributes:
        recipe: torchao's recipe name; scaling is dynamic (current) in every one.
        emulate: whether the FP8 GEMMs are emulated (numerics only: dequantize and
            multiply in fp32) rather than run on FP8 units.
        emulate_reason: why, in one phrase.
        converted: qualified names of the layers that run as ``Float8Linear``.
        kept: the `nn.Linear` layers left in 16 bits, each with its reason.
        settings: the policy's `Float8Training`.
    """

    recipe: str
    emulate: bool
    emulate_reason: str
    converted: tuple[str, ...]
    kept: tuple[KeptLayer, ...]
    settings: Float8Training

    @property
    def scaling(self) -> str:
        """The scaling every cast of the recipe uses: ``"dynamic"``."""
        return "dynamic"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what run records keep under ``effective.fp8``)."""
        return {
            "recipe": self.recipe,
            "scaling": self.scaling,
            "emulate": self.emulate,
            "emulate_reason": self.emulate_reason,
            "converted": list(self.converted),
            "kept": [{"name": k.name, "reason": k.reason} for k in self.kept],
            "settings": self.settings.to_dict(),
        }

    def describe(self) -> str:
        """A few lines: the recipe, emulation, and the layers converted and kept."""
        how = "emulated" if self.emulate else "FP8 GEMMs"
        lines = [
            f"fp8 linears: {self.recipe}, dynamic scaling, {how} ({self.emulate_reason}); "
            f"{len(self.converted)} converted, {len(self.kept)} kept in 16 bits"
        ]
        if self.converted:
            lines.append(f"  converted: {_names(self.converted)}")
        for k in self.kept:
            lines.append(f"  kept {k.name or '<model>'}: {k.reason}")
        return "\n".join(lines)


def _names(names: tuple[str, ...], limit: int = 8) -> str:
    shown = [n or "<model>" for n in names[:limit]]
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(shown) + more


def refuse_float8_layers(model: nn.Module, policy: str, *, fix: str = "prepare") -> None:
    """Refuse a policy without fp8 over a model whose layers an FP8 policy converted: they
    would keep training in FP8 while the run says otherwise.

    Raises:
        PrecisionError: the model holds ``Float8Linear`` layers (the message names them
            and says to `fix` a model that was not converted).
    """
    converted = [n or "<model>" for n, m in model.named_modules() if is_float8_linear(m)]
    if converted:
        shown = ", ".join(converted[:4]) + (
            f", ... ({len(converted)} in all)" if len(converted) > 4 else ""
        )
        raise PrecisionError(
            f"policy {policy!r} has no fp8 settings, but the model holds torchao Float8Linear "
            f"layers ({shown}) from an FP8 policy's prepare: they would keep training in FP8; "
            f"fix: {fix} a model that was not converted, or use an FP8 policy"
        )


def refuse_other_float8_config(
    model: nn.Module,
    settings: Float8Training,
    *,
    emulate: bool,
    policy: str,
    config: Any = None,
    fix: str = "prepare",
) -> None:
    """Refuse fp8 `settings` over a model whose ``Float8Linear`` layers an earlier
    `prepare` converted with another torchao config (recipe or `emulate`).

    Args:
        config: torchao's config for `settings` (built here when None and needed).
        fix: what the message asks to do with a model that was not converted.

    Raises:
        PrecisionError: a layer's config differs, naming the layer.
    """
    layers = [(n, m) for n, m in model.named_modules() if is_float8_linear(m)]
    if not layers:
        return
    if config is None:
        config = float8_linear_config(settings, emulate=emulate)
    for name, module in layers:
        if module.config != config:
            raise PrecisionError(
                f"policy {policy!r}: layer {name or '<model>'!r} is already a Float8Linear "
                f"with another torchao config than fp8 {settings.recipe!r} "
                f"(emulate={emulate}); {fix} a model that was not converted before"
            )


def convert_fp8_linears(
    model: nn.Module,
    settings: Float8Training,
    *,
    device: torch.device,
    islands: tuple[str, ...] = (),
    policy: str = "custom",
    wrapped: bool = False,
) -> tuple[nn.Module, Float8Conversion]:
    """Swap the eligible `nn.Linear` layers of `model` for torchao's ``Float8Linear``.

    In place, but for a model that is itself an eligible `nn.Linear`: torchao then
    returns a new module (holding the same parameters), returned here. Layers already
    converted get the input cast only. Parameters keep their identity, dtype and device.
    A model already `wrapped` by FSDP2 or DDP is refused when a layer would change
    (the wrappers hold the old modules). When no layer qualifies, a `PrecisionWarning`
    says the model trains entirely in 16 bits, and why each layer was kept.

    Returns:
        The model (see above) and the `Float8Conversion`.

    Raises:
        ImportError: torchao is missing, with the install line (whatever the model).
        PrecisionError: ``emulate=False`` on a device without FP8 units; a layer
            already converted with another torchao config; a wrapped model.
    """
    float8 = load_torchao_float8(f"policy {policy!r}")  # even when no layer qualifies
    emulate, why = _resolve_emulate(settings, device, policy)
    config = float8_linear_config(settings, emulate=emulate)
    convert, kept = fp8_layer_choice(model, settings, islands=islands)
    fresh = {id(m) for _, m in convert if not is_float8_linear(m)}
    refuse_other_float8_config(model, settings, emulate=emulate, policy=policy, config=config)
    if fresh and wrapped:
        raise PrecisionError(
            f"policy {policy!r}: the model is already wrapped (FSDP2/DDP), so its "
            f"{len(fresh)} eligible nn.Linear layers cannot become Float8Linear now; fix: "
            "call prec.prepare(model) before mixprec.distributed.shard/ddp"
        )
    if fresh:
        model = float8.convert_to_float8_training(
            model,
            config=config,
            module_filter_fn=lambda module, _fqn: id(module) in fresh,
        )
    converted: list[str] = []
    for name, module in model.named_modules():
        if is_float8_linear(module):
            _add_input_cast(module)
            converted.append(name)
    if not converted:
        shown = "; ".join(f"{k.name or '<model>'}: {k.reason}" for k in kept[:4])
        more = f"; ... ({len(kept) - 4} more)" if len(kept) > 4 else ""
        warnings.warn(
            f"policy {policy!r}: no nn.Linear of the model qualifies for fp8 "
            f"{settings.recipe!r}, so it trains entirely in 16 bits "
            f"({shown or 'the model has no nn.Linear'}{more}); relax the fp8 filter "
            "(min_divisor, skip_first_last, exclude) or choose a 16-bit policy",
            PrecisionWarning,
            stacklevel=user_stacklevel(),
        )
    return model, Float8Conversion(
        recipe=settings.recipe,
        emulate=emulate,
        emulate_reason=why,
        converted=tuple(converted),
        kept=tuple(kept),
        settings=settings,
    )
