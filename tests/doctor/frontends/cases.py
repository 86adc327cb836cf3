"""Shared cases of the config front-end tests: fixtures, the rules each triggers."""

from __future__ import annotations

from pathlib import Path

from mixprec.device import DeviceCaps

FIXTURES = Path(__file__).parents[1] / "fixtures"

# (fixture, the exact set of rules it triggers, the severity of each finding)
MIXPREC_CASES = [
    ("optimizer-state-16bit.yaml", {"optimizer-state-16bit"}, "error"),
    ("optimizer-state-16bit-peft.yaml", {"optimizer-state-16bit"}, "warning"),
    ("fp16-without-loss-scaling.yaml", {"fp16-without-loss-scaling"}, "error"),
    ("loss-scaling-unneeded.yaml", {"loss-scaling-unneeded"}, "info"),
    ("reduce-dtype-16bit.yaml", {"reduce-dtype-16bit"}, "warning"),
    ("master-without-16bit-params.yaml", {"master-without-16bit-params"}, "warning"),
    ("format-not-accelerated.yaml", {"format-not-accelerated"}, "warning"),
    ("norm-in-16bit.yaml", {"norm-in-16bit"}, "warning"),
    ("fp8-without-scaling.yaml", {"fp8-without-scaling"}, "error"),
]
NEMO_CASES = [
    ("optimizer-state-16bit.yaml", {"optimizer-state-16bit"}, "error"),
    ("optimizer-state-16bit-peft.yaml", {"optimizer-state-16bit"}, "warning"),
    ("optimizer-state-16bit-short.yaml", {"optimizer-state-16bit"}, "warning"),
    ("fp16-without-loss-scaling.yaml", {"fp16-without-loss-scaling"}, "error"),
    ("reduce-dtype-16bit.yaml", {"reduce-dtype-16bit"}, "warning"),
    ("reduce-dtype-16bit-unset.yaml", {"reduce-dtype-16bit"}, "warning"),
    ("master-without-16bit-params.yaml", {"master-without-16bit-params"}, "warning"),
    ("norm-in-16bit.yaml", {"norm-in-16bit"}, "warning"),
    ("fp8-without-scaling.yaml", {"fp8-without-scaling"}, "error"),
]
#: Rules only live objects can trigger (they read what a wrapped model does): tested with
#: real wrappers in tests/distributed/test_doctor_live.py and fakes in tests/doctor/rules.
LIVE_ONLY = {"fsdp-without-mixed-precision"}
# NeMo AutoModel recipes have no loss-scaler key, so loss-scaling-unneeded has no NeMo
# fixture; format-not-accelerated needs a target device (test below).
CLEAN = [
    "mixprec/clean_fp32_adamw.yaml",
    "mixprec/clean_amp_bf16.yaml",
    "mixprec/clean_amp_fp16.yaml",
    "mixprec/clean_bf16_master.yaml",
    "nemo/clean_fp32_adamw.yaml",
    "nemo/clean_te_fused_adam.yaml",
    "nemo/clean_mixprec_adamw.yaml",
    "nemo/clean_flashoptim.yaml",
]

V100 = DeviceCaps(
    device_type="cuda",
    name="Tesla V100 (sm_70)",
    bf16_supported=True,
    fp16_supported=True,
    bf16_fast=False,
    fp16_fast=True,
    bf16_reason="sm_70 predates Ampere: no bf16 tensor cores",
    fp16_reason="sm_70 has fast fp16",
)


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


NEMO_BASE = """
step_scheduler:
  max_steps: 50000
model:
  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained
  torch_dtype: bfloat16
"""
