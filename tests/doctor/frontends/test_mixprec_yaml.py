from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mixprec.doctor import check_file, detect_format

from .cases import FIXTURES, MIXPREC_CASES, NEMO_BASE, write


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


def test_mixprec_values_are_validated_with_valid_options(tmp_path: Path) -> None:
    bad_opt = "precision:\n  preset: fp32\noptimizer:\n  name: lamb\n"
    with pytest.raises(ValueError, match=r"unknown optimizer 'lamb'; valid: .*torch.optim.adamw"):
        check_file(write(tmp_path, bad_opt))
    bad_key = "precision:\n  preset: fp32\n  compute_dtyp: bf16\n"
    with pytest.raises(ValueError, match="unknown policy keys"):
        check_file(write(tmp_path, bad_key, "k.yaml"))
    bad_fp8 = "precision:\n  preset: amp_bf16\nfp8:\n  enabled: true\n  scaling: magic\n"
    with pytest.raises(ValueError, match="unknown fp8 scaling 'magic'; valid: tensorwise"):
        check_file(write(tmp_path, bad_fp8, "f.yaml"))
    bad_dtype = NEMO_BASE.replace("bfloat16", "bfloat12")
    with pytest.raises(ValueError, match=r"model.torch_dtype.*unknown dtype 'bfloat12'"):
        check_file(write(tmp_path, bad_dtype, "d.yaml"))


@pytest.mark.parametrize("device", ["tpu", "''"])
def test_an_unknown_device_is_one_line_naming_the_key(tmp_path: Path, device: str) -> None:
    text = (FIXTURES / "mixprec" / "clean_amp_bf16.yaml").read_text()
    path = write(tmp_path, text + f"device: {device}\n" if "device:" not in text else text)
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


def test_loss_scaling_null_over_a_scaling_preset_points_at_that_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "precision:\n  preset: amp_fp16\n  loss_scaling: null\noptimizer:\n  name: adamw\n",
    )
    (finding,) = check_file(path)
    assert finding.rule == "fp16-without-loss-scaling"
    assert finding.where == f"{path}:3 precision.loss_scaling"
    assert "remove" in finding.fix and "loss_scaling: null" in finding.fix
    assert "use preset amp_fp16" not in finding.fix
