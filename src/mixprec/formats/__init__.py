"""Storage formats of optimizer state: master weights and moments, and their registry.

Each format is one module under `masters/` or `moments/` that declares a spec
(state tensors with dtypes and bytes per element, exactness, the parameter
dtypes it needs, its native kernel code) and holds its encode/decode.
Importing this package registers the built-in formats; every table elsewhere
(policy checks, memory model, doctor, optimizer-state accounting, native
kernel codes) is derived from the registry. Only torch is imported here, so
policies can validate names without loading the optimizer.
"""

# The built-in formats register themselves when their modules are imported.
from mixprec.formats.masters import MasterFormat
from mixprec.formats.moments import MomentFormat
from mixprec.formats.registry import (
    auto_master,
    check_master,
    check_moments,
    master_format,
    master_names,
    master_spec,
    master_specs,
    master_state_keys,
    moment_format,
    moment_names,
    moment_spec,
    moment_specs,
    moment_state_keys,
    register_master,
    register_moments,
    resolve_master,
)
from mixprec.formats.spec import MasterSpec, MomentSpec, StateTensor

#: The built-in master formats, in table order.
MASTER_KINDS: tuple[str, ...] = master_names()
#: The built-in moment formats, in table order.
MOMENT_KINDS: tuple[str, ...] = moment_names()

__all__ = [
    "MASTER_KINDS",
    "MOMENT_KINDS",
    "MasterFormat",
    "MasterSpec",
    "MomentFormat",
    "MomentSpec",
    "StateTensor",
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
