"""Master-weight formats: how the full-precision value of a parameter is kept."""

from mixprec.optim.masters.base import MasterFormat
from mixprec.optim.masters.exact import ExactMaster
from mixprec.optim.masters.fp32 import Fp32Master
from mixprec.optim.masters.kahan import KahanMaster
from mixprec.optim.masters.none import NoMaster
from mixprec.optim.masters.remainder8 import Remainder8Master
from mixprec.optim.masters.resync import resync_master
from mixprec.optim.masters.stochastic import StochasticMaster, stochastic_round

__all__ = [
    "ExactMaster",
    "Fp32Master",
    "KahanMaster",
    "MasterFormat",
    "NoMaster",
    "Remainder8Master",
    "StochasticMaster",
    "resync_master",
    "stochastic_round",
]
