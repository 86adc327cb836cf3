"""The registry of storage formats: name -> spec and implementation, and the ``auto`` rule.

Each format module registers itself when imported (this module imports the
built-in ones at its end); everything that needs a fact about a format (the
optimizer, the policy checks, the memory model, the doctor, the native kernel's
codes) looks it up here. Importing it loads no torch (the format modules import
torch only inside their tensor code), so torch-free callers such as the
doctor's static config checks read the same registry as the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mixprec.floats import canonical_name
from mixprec.formats.spec import MasterSpec, MomentSpec

if TYPE_CHECKING:
    from mixprec.formats.masters.base import MasterFormat
    from mixprec.formats.moments.base import MomentFormat

__all__ = [
    "DEFAULT_MASTER",
    "DEFAULT_MOMENTS",
    "TORCH_MOMENT_KEYS",
    "auto_master",
    "check_master",
    "check_moments",
    "master_format",
    "master_names",
    "master_spec",
    "master_specs",
    "master_state_keys",
    "moment_format",
    "moment_names",
    "moment_spec",
    "moment_specs",
    "moment_state_keys",
    "register_master",
    "register_moments",
    "resolve_master",
]

#: What `mixprec.optim.AdamW` keeps when not told: the ``auto`` master rule
#: (`auto_master`), and fp32 moments (torch's AdamW state).
DEFAULT_MASTER = "auto"
DEFAULT_MOMENTS = "fp32"

_MASTERS: dict[str, MasterFormat] = {}
_MOMENTS: dict[str, tuple[MomentSpec, Callable[[int], MomentFormat]]] = {}

#: Moment-like state of torch's own optimizers that no mixprec format stores, counted
#: as moments by accounting: AdamW's AMSGrad maximum ``max_exp_avg_sq``, SGD's and
#: RMSprop's ``momentum_buffer``, RMSprop's and Adadelta's ``square_avg``, Adagrad's ``sum``.
TORCH_MOMENT_KEYS: frozenset[str] = frozenset(
    {"max_exp_avg_sq", "momentum_buffer", "square_avg", "sum"}
)


def _check_new(
    spec: MasterSpec | MomentSpec,
    taken: tuple[MasterSpec, ...] | tuple[MomentSpec, ...],
    other_keys: frozenset[str],
) -> None:
    name, code = spec.name, spec.kernel_code
    if name in {s.name for s in taken}:
        raise ValueError(f"a format named {name!r} is already registered")
    if code is not None and code in {s.kernel_code for s in taken}:
        raise ValueError(f"format {name!r}: kernel code {code} is already taken")
    clash = sorted(set(spec.state_keys) & other_keys)
    if clash:
        raise ValueError(
            f"format {name!r}: state keys {clash} are already used by the other kind of "
            "format (master state and moment state share one optimizer-state dict)"
        )


def register_master(fmt: MasterFormat) -> None:
    """Add a master format (its `spec` names it); names and kernel codes are unique."""
    spec = getattr(fmt, "spec", None)
    if not isinstance(spec, MasterSpec):
        raise TypeError(f"register_master takes a format whose spec is a MasterSpec, got {spec!r}")
    moment_keys = frozenset(k for s in moment_specs() for k in s.state_keys)
    _check_new(spec, master_specs(), moment_keys)
    _MASTERS[spec.name] = fmt


def register_moments(spec: MomentSpec, build: Callable[[int], MomentFormat]) -> None:
    """Add a moment format: its spec and a builder taking the int8 block size."""
    if not isinstance(spec, MomentSpec):
        raise TypeError(f"register_moments takes a MomentSpec, got {type(spec).__name__}")
    if not callable(build):
        raise TypeError(f"format {spec.name!r}: build must take the block size, got {build!r}")
    _check_new(spec, moment_specs(), master_state_keys())
    _MOMENTS[spec.name] = (spec, build)


def master_names() -> tuple[str, ...]:
    """The registered master formats, in registration order."""
    return tuple(_MASTERS)


def moment_names() -> tuple[str, ...]:
    """The registered moment formats, in registration order."""
    return tuple(_MOMENTS)


def master_specs() -> tuple[MasterSpec, ...]:
    """Every registered master spec."""
    return tuple(fmt.spec for fmt in _MASTERS.values())


def moment_specs() -> tuple[MomentSpec, ...]:
    """Every registered moment spec."""
    return tuple(spec for spec, _ in _MOMENTS.values())


def check_master(value: object, *, auto: bool = False) -> str:
    """Validate a master format name (and ``auto`` when `auto`), raising `ValueError`
    listing the valid ones."""
    if auto and value == "auto":
        return value
    if not isinstance(value, str) or value not in _MASTERS:
        valid = ", ".join(("auto", *_MASTERS) if auto else _MASTERS)
        raise ValueError(f"unknown master {value!r}; valid: {valid}")
    return value


def check_moments(value: object) -> str:
    """Validate a moment format name, raising `ValueError` listing the valid ones."""
    if not isinstance(value, str) or value not in _MOMENTS:
        raise ValueError(f"unknown moments {value!r}; valid: {', '.join(_MOMENTS)}")
    return value


def master_spec(name: str) -> MasterSpec:
    """The spec of master format `name`."""
    return _MASTERS[check_master(name)].spec


def moment_spec(name: str) -> MomentSpec:
    """The spec of moment format `name`."""
    return _MOMENTS[check_moments(name)][0]


def master_format(name: str) -> MasterFormat:
    """The master format named `name`."""
    return _MASTERS[check_master(name)]


def moment_format(name: str, *, block_size: int = 256) -> MomentFormat:
    """The moment format named `name` (`block_size` is used by blockwise formats)."""
    return _MOMENTS[check_moments(name)][1](block_size)


def master_state_keys() -> frozenset[str]:
    """Every optimizer-state key a master format stores."""
    return frozenset(key for spec in master_specs() for key in spec.state_keys)


def moment_state_keys() -> frozenset[str]:
    """Every optimizer-state key a moment format stores, and `TORCH_MOMENT_KEYS`."""
    keys = {key for spec in moment_specs() for key in spec.state_keys}
    return frozenset(keys) | TORCH_MOMENT_KEYS


def auto_master(dtype: object) -> str:
    """The ``auto`` rule: ``exact`` for bf16, ``fp32`` for fp16, ``none`` otherwise
    (`dtype` a `torch.dtype` or a name)."""
    try:
        name = canonical_name(dtype)
    except (TypeError, ValueError):
        return "none"
    if name == "bf16":
        return "exact"
    if name == "fp16":
        return "fp32"
    return "none"


def resolve_master(requested: str, dtype: object) -> MasterFormat:
    """The format for a parameter of `dtype` (``auto`` resolved), validated for the dtype."""
    if requested == "auto":
        fmt = _MASTERS[auto_master(dtype)]
    else:
        if requested not in _MASTERS:
            raise ValueError(f"unknown master {requested!r}; valid: auto, {', '.join(_MASTERS)}")
        fmt = _MASTERS[requested]
    fmt.spec.check_param_dtype(dtype)
    return fmt


# The built-in formats register themselves when imported; importing them here (after
# the functions above exist) makes the registry complete however it is first reached.
import mixprec.formats.masters  # noqa: E402
import mixprec.formats.moments  # noqa: E402, F401
