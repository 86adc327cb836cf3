"""Master-weight formats: how the full-precision value of a parameter is kept.

One module per format holds all of it: its `MasterSpec` (plain data), its
encode and decode, and its registration (so the import order below is the
registry's, and the tables', order). A format module imports torch inside the
functions that use tensors, not at its top: importing it declares the spec
without loading torch, so the registry is readable by torch-free callers (the
doctor's static config checks, ``mixprec policies``).
"""

# isort: skip_file
from mixprec.formats.masters.base import MasterFormat
from mixprec.formats.masters.none import NoMaster
from mixprec.formats.masters.fp32 import Fp32Master
from mixprec.formats.masters.exact import ExactMaster
from mixprec.formats.masters.remainder8 import Remainder8Master
from mixprec.formats.masters.kahan import KahanMaster
from mixprec.formats.masters.stochastic import StochasticMaster, stochastic_round

__all__ = [
    "ExactMaster",
    "Fp32Master",
    "KahanMaster",
    "MasterFormat",
    "NoMaster",
    "Remainder8Master",
    "StochasticMaster",
    "stochastic_round",
]
