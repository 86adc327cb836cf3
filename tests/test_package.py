"""`import mixprec`: light, lazy, and every public subpackage reachable from it
(the names themselves: tests/test_public_api.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("type(mixprec.doctor.Probe).__name__", "type"),
        ("mixprec.memory.estimate.__module__", "mixprec.memory.estimation"),
        ("mixprec.formats.master_spec('exact').bytes_per_element", "2"),
        ("mixprec.optim.AdamW.__name__", "AdamW"),
        ("mixprec.checkpoint.save.__module__", "mixprec.checkpoint.saving"),
        ("mixprec.report.__name__", "rerender"),
        ("mixprec.preset('fp32').name", "fp32"),
        ("mixprec.speed.measure_speed.__module__", "mixprec.speed.measure"),
        ("mixprec.distributed.shard.__module__", "mixprec.distributed.fsdp"),
    ],
)
def test_subpackages_and_library_calls_are_reachable_after_import_mixprec(
    expression: str, expected: str
) -> None:
    assert _run(f"import mixprec; print({expression})") == expected


def test_the_experiment_does_not_load_matplotlib_until_it_plots() -> None:
    assert _run("import sys, mixprec.experiment; print('matplotlib' in sys.modules)") == "False"


def test_no_tracker_backend_is_loaded_until_a_run_is_tracked() -> None:
    loaded = _run(
        "import sys, mixprec.experiment, mixprec.cli.app, mixprec.tracking; "
        "print(sorted(m for m in ('mlflow', 'tensorboard', 'torch.utils.tensorboard') "
        "if m in sys.modules))"
    )
    assert loaded == "[]"


def test_torchao_is_imported_only_for_an_fp8_policy() -> None:
    """torchao prints failed extension loads and warnings when imported (0.18 on CPU):
    mixprec imports it in `Precision.prepare` under an FP8 policy and nowhere else."""
    code = """
import sys, warnings
import torch
from torch import nn
import mixprec
from mixprec.doctor import Probe
from mixprec.policy import PRESET_NAMES
warnings.simplefilter("ignore")
for name in PRESET_NAMES:
    prec = mixprec.Precision(name)  # FP8 presets too: the policy is plain data
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    mixprec.memory.estimate(model, name, inputs=torch.randn(2, 4))  # FP8 too: no torchao
    if prec.policy.fp8 is not None:
        continue
    model = prec.prepare(model)
    opt = prec.optimizer(model, lr=1e-3)
    with Probe(model=model).watching(prec):
        with prec.autocast():
            x = torch.randn(2, 4, dtype=next(model.parameters()).dtype)
            loss = model(x).float().sum()
        prec.backward(loss)
        prec.step(opt)
print(sorted(m for m in sys.modules if m.split(".")[0] == "torchao"))
"""
    assert _run(code) == "[]"
