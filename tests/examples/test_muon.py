"""examples/muon.py runs as written and learns (Muon + AdamW, exact masters, bf16)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "muon.py"


def test_the_muon_example_learns() -> None:
    spec = importlib.util.spec_from_file_location("muon_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main(steps=30)
    assert len(losses) == 30
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
