"""mixprec inside other people's training loops, one module per trainer.

Each module imports its trainer library on import, so ``import mixprec`` never
does: import the one you use (``from mixprec.integrations.hf import PrecisionTrainer``,
``from mixprec.integrations.lightning import MixprecPrecision``,
``from mixprec.integrations.accelerate import AcceleratedPrecision``).
"""

from __future__ import annotations

__all__: list[str] = []
