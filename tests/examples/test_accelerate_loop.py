"""examples/accelerate_loop.py runs as written and learns (32 steps of a tiny Llama)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the accelerate extra is not installed")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).parents[2] / "examples" / "accelerate_loop.py"


def test_the_accelerate_example_trains_under_amp_fp16(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("accelerate_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "accelerate_loop", module)
    spec.loader.exec_module(module)
    losses = module.main("amp_fp16", steps=16)
    assert len(losses) == 32  # 16 steps of 2 micro-batches
    assert sum(losses[-4:]) < sum(losses[:4])
    assert not list(tmp_path.iterdir())
