from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from mixprec.device import DeviceCaps
from mixprec.doctor import STATIC_RULES, check_file, detect_format, load_config
from mixprec.dtypes import format_info

FIXTURES = Path(__file__).parent / "fixtures"

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


@pytest.mark.parametrize(("name", "rules", "severity"), MIXPREC_CASES)
def test_mixprec_fixture_triggers_exactly_its_rule(
    name: str, rules: set[str], severity: str
) -> None:
    path = FIXTURES / "mixprec" / name
    assert detect_format(yaml.safe_load(path.read_text())) == "mixprec"
    findings = check_file(path)
    assert {f.rule for f in findings} == rules
    assert {f.severity for f in findings} == {severity}
    for f in findings:
        assert f.where.startswith(str(path)) and f.message and f.fix and f.evidence


@pytest.mark.parametrize(("name", "rules", "severity"), NEMO_CASES)
def test_nemo_fixture_triggers_exactly_its_rule(name: str, rules: set[str], severity: str) -> None:
    path = FIXTURES / "nemo" / name
    assert detect_format(yaml.safe_load(path.read_text())) == "nemo"
    findings = check_file(path)
    assert {f.rule for f in findings} == rules
    assert {f.severity for f in findings} == {severity}


def test_every_static_rule_has_a_fixture_in_each_format() -> None:
    assert {r for _, rules, _ in MIXPREC_CASES for r in rules} == set(STATIC_RULES)
    nemo = {r for _, rules, _ in NEMO_CASES for r in rules} | {"format-not-accelerated"}
    assert nemo == set(STATIC_RULES) - {"loss-scaling-unneeded"}


@pytest.mark.parametrize("name", CLEAN)
def test_clean_configs_have_no_findings(name: str) -> None:
    assert check_file(FIXTURES / name) == []


def test_nemo_format_not_accelerated_for_a_pre_ampere_target() -> None:
    path = FIXTURES / "nemo" / "format-not-accelerated.yaml"
    assert check_file(path) == []  # no target device: not judged
    (f,) = check_file(path, device=V100)
    assert f.rule == "format-not-accelerated" and f.severity == "warning"
    assert f.evidence["requested"] == "bf16" and f.evidence["fast"] is False
    assert "predates Ampere" in f.message
    assert "distributed.mp_policy.param_dtype" in f.where


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_nemo_auto_dtype_is_treated_as_bf16_and_says_so() -> None:
    for name, how in (
        ("optimizer-state-16bit.yaml", "unset"),
        ("optimizer-state-16bit-short.yaml", "auto"),
    ):
        path = FIXTURES / "nemo" / name
        (f,) = check_file(path)
        assert f.evidence["param_dtype"] == "bf16"
        assert how in f.evidence["param_dtype_source"]
        assert "treated as bf16" in f.evidence["param_dtype_source"]
        line = _line_of(path, "_target_: torch.optim.")
        assert f.where == f"{path}:{line} optimizer._target_"


def test_nemo_severity_follows_run_length_and_peft() -> None:
    (short,) = check_file(FIXTURES / "nemo" / "optimizer-state-16bit-short.yaml")
    assert short.evidence["steps"] == 60 and "short" in short.message
    (peft,) = check_file(FIXTURES / "nemo" / "optimizer-state-16bit-peft.yaml")
    assert peft.evidence["peft"] is True and peft.evidence["full_parameter_training"] is False
    (full,) = check_file(FIXTURES / "nemo" / "optimizer-state-16bit.yaml")
    assert full.severity == "error" and full.evidence["moments"] == "bf16"
    assert full.evidence["lost_update_below_at_1"] == format_info("bf16").min_update_at_one


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
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


def test_te_fused_adam_without_master_over_bf16_is_flagged(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        NEMO_BASE
        + """
optimizer:
  _target_: transformer_engine.pytorch.optimizers.FusedAdam
  lr: 1.0e-4
""",
    )
    (f,) = check_file(path)
    assert f.rule == "optimizer-state-16bit" and f.severity == "error"
    assert f.evidence["master"] == "none" and f.evidence["moments"] == "fp32"


def test_te_fused_adam_with_master_but_bf16_moments_is_info(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        NEMO_BASE
        + """
optimizer:
  _target_: transformer_engine.pytorch.optimizers.fused_adam.FusedAdam
  master_weights: true
  store_param_remainders: true
  exp_avg_dtype: torch.bfloat16
  exp_avg_sq_dtype: torch.bfloat16
""",
    )
    (f,) = check_file(path)
    assert (f.rule, f.severity) == ("optimizer-state-16bit", "info")
    assert f.evidence["master"] == "exact" and f.evidence["moments"] == "bf16"


def test_megatron_fsdp_reduces_in_bf16_by_default(tmp_path: Path) -> None:
    text = NEMO_BASE + "distributed:\n  strategy: megatron_fsdp\n"
    (f,) = check_file(_write(tmp_path, text))
    assert (
        f.rule == "reduce-dtype-16bit"
        and "grad_reduce_in_fp32" in f.evidence["reduce_dtype_source"]
    )
    fixed = text + "  grad_reduce_in_fp32: true\n"
    assert check_file(_write(tmp_path, fixed, "fixed.yaml")) == []


def test_nothing_in_a_config_is_imported(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
model:
  _target_: mixprec_doctor_never_imported.Model
  torch_dtype: float32
optimizer:
  _target_: mixprec_doctor_never_imported_either.Optimizer
distributed:
  mp_policy:
    _target_: mixprec_doctor_never_imported_too.Policy
    param_dtype: float16
""",
    )
    assert check_file(path) == []
    assert not any(m.startswith("mixprec_doctor_never") for m in sys.modules)


def test_python_tags_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "created"
    path = _write(tmp_path, f"precision: !!python/object/apply:os.mkdir ['{marker}']\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        check_file(path)
    assert not marker.exists()


def test_bad_input_raises_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_file(tmp_path / "missing.yaml")
    broken = _write(tmp_path, "precision:\n  preset: [bf16\n")
    with pytest.raises(ValueError, match=r"recipe\.yaml:\d+: not valid YAML") as exc:
        check_file(broken)
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match=r"cannot tell the config format.*--format"):
        check_file(_write(tmp_path, "seed: 3\nlr: 0.1\n", "odd.yaml"))
    with pytest.raises(ValueError, match="needs a top-level 'precision:'"):
        check_file(FIXTURES / "nemo" / "clean_te_fused_adam.yaml", format="mixprec")
    with pytest.raises(ValueError, match="unknown config format 'yaml'"):
        check_file(FIXTURES / "mixprec" / "clean_amp_bf16.yaml", format="yaml")


def test_mixprec_values_are_validated_with_valid_options(tmp_path: Path) -> None:
    bad_opt = "precision:\n  preset: fp32\noptimizer:\n  name: lion\n"
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'; valid: .*torch.optim.adamw"):
        check_file(_write(tmp_path, bad_opt))
    bad_key = "precision:\n  preset: fp32\n  compute_dtyp: bf16\n"
    with pytest.raises(ValueError, match="unknown policy keys"):
        check_file(_write(tmp_path, bad_key, "k.yaml"))
    bad_fp8 = "precision:\n  preset: amp_bf16\nfp8:\n  enabled: true\n  scaling: magic\n"
    with pytest.raises(ValueError, match="unknown fp8 scaling 'magic'; valid: tensorwise"):
        check_file(_write(tmp_path, bad_fp8, "f.yaml"))
    bad_dtype = NEMO_BASE.replace("bfloat16", "bfloat12")
    with pytest.raises(ValueError, match=r"model.torch_dtype.*unknown dtype 'bfloat12'"):
        check_file(_write(tmp_path, bad_dtype, "d.yaml"))


def test_load_config_exposes_the_facts() -> None:
    facts = load_config(FIXTURES / "nemo" / "clean_te_fused_adam.yaml")
    assert facts.dialect == "nemo" and str(facts.param_dtype) == "torch.bfloat16"
    assert facts.optimizer is not None
    (group,) = facts.optimizer.groups
    assert (group.master, group.moments) == ("exact", "fp32")
    assert str(facts.reduce_dtype) == "torch.float32" and facts.steps == 100000


@pytest.mark.parametrize("device", ["tpu", "''"])
def test_an_unknown_device_is_one_line_naming_the_key(tmp_path: Path, device: str) -> None:
    text = (FIXTURES / "mixprec" / "clean_amp_bf16.yaml").read_text()
    path = _write(tmp_path, text + f"device: {device}\n" if "device:" not in text else text)
    path.write_text(
        "\n".join(
            f"device: {device}" if line.startswith("device:") else line
            for line in path.read_text().splitlines()
        )
        + "\n"
    )
    with pytest.raises(ValueError, match="unknown device") as exc:
        check_file(path)
    assert "\n" not in str(exc.value)
