"""What the HF Trainer, Accelerate and Lightning really do with fp16 on a CPU.

The config front ends used to describe ``fp16: true`` on a CPU as fp16 autocast
(emulated on CPUs without fp16 units). The trainers do something else: the HF
Trainer and Accelerate run without autocast or a loss scaler, Lightning swaps
``16-mixed`` for ``bf16-mixed``. The last tests check those claims against the
installed trainers, so a trainer release that changes them fails here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from mixprec.device import DeviceCaps
from mixprec.doctor.frontends.dispatch import check_file

#: A CPU without fp16 units (Cascade Lake, Zen 4): where the old wording said "emulated".
CPU_NO_FP16 = DeviceCaps(
    device_type="cpu",
    name="test CPU",
    bf16_supported=True,
    fp16_supported=True,
    bf16_fast=True,
    fp16_fast=False,
    bf16_reason="avx512_bf16",
    fp16_reason="no AVX512-FP16/AMX-FP16",
)
GPU = DeviceCaps(
    device_type="cuda",
    name="test GPU",
    bf16_supported=True,
    fp16_supported=True,
    bf16_fast=True,
    fp16_fast=True,
    bf16_reason="tensor cores",
    fp16_reason="tensor cores",
)

#: (config text, the front end, what the finding says runs)
CASES = [
    ("fp16: true\nlearning_rate: 1.0e-4\n", "hf", "fp32"),
    ("mixed_precision: fp16\ndistributed_type: 'NO'\n", "accelerate", "the model's own dtype"),
    ("trainer:\n  precision: 16-mixed\n  devices: 1\n", "lightning", "bf16"),
    ("base_model: some/llama\nfp16: true\nmicro_batch_size: 2\n", "axolotl", "fp16"),
]


@pytest.mark.parametrize(("text", "fmt", "runs"), CASES, ids=[c[1] for c in CASES])
def test_fp16_on_a_cpu_is_named_as_what_the_trainer_runs(
    tmp_path: Path, text: str, fmt: str, runs: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    found = check_file(path, device=CPU_NO_FP16)
    [finding] = [f for f in found if f.rule == "format-not-accelerated"]
    assert finding.severity == "warning"
    assert "emulated" not in finding.message
    assert finding.evidence["requested"] == "fp16"
    assert finding.evidence["effective"] == runs
    assert f"matmuls run in {runs}, with no loss scaling" in finding.message
    assert "bf16" in finding.fix


@pytest.mark.parametrize(("text", "fmt", "runs"), CASES, ids=[c[1] for c in CASES])
def test_fp16_on_a_gpu_is_left_as_written(tmp_path: Path, text: str, fmt: str, runs: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert not [f for f in check_file(path, device=GPU) if f.rule == "format-not-accelerated"]


def test_accelerate_runs_fp16_on_a_cpu_without_autocast_or_scaler() -> None:
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    assert not acc.native_amp and acc.scaler is None
    with acc.autocast():
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert out.dtype == torch.float32


def test_hf_trainer_passes_fp16_to_an_accelerator_without_amp_on_a_cpu(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), fp16=True, use_cpu=True, report_to=[]
    )
    model = torch.nn.Linear(2, 2)
    trainer = transformers.Trainer(model=model, args=args)
    assert args.fp16 and trainer.accelerator.mixed_precision == "fp16"
    assert not trainer.accelerator.native_amp and trainer.accelerator.scaler is None


def test_lightning_turns_16_mixed_into_bf16_mixed_on_a_cpu() -> None:
    lightning = pytest.importorskip("lightning")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fabric = lightning.Fabric(accelerator="cpu", devices=1, precision="16-mixed")
    assert fabric._precision.precision == "bf16-mixed"
    assert any("not supported on CPU" in str(w.message) for w in seen)
