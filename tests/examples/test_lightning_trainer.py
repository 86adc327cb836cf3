"""examples/lightning_trainer.py runs as written (64 steps of a tiny Llama)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).parents[2] / "examples" / "lightning_trainer.py"


def test_the_lightning_example_trains_under_amp_fp16(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "amp_fp16"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "steps 64" in out and "loss scaling: dynamic" in out
    assert not list(tmp_path.iterdir())  # it writes nothing where it runs
