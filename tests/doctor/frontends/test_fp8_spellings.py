"""fp8 recipes as the ecosystem's configs spell them: each scaled recipe is read (and
``fp8-without-scaling`` stays silent), unknown names are refused as their frameworks
refuse them, fp8 without a recipe is an error, and emulated fp8 is
``format-not-accelerated``. Real files are vendored (sources in each fixture
directory's SOURCES.md); the others are those files with one key changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.device import DeviceCaps
from mixprec.doctor import check_file, load_config

from .cases import FIXTURES, write

FNA, F8 = "format-not-accelerated", "fp8-without-scaling"
ACC = FIXTURES / "accelerate"
NEMO = FIXTURES / "ecosystem" / "nemo_automodel"
MEGATRON = FIXTURES / "nemo1" / "megatron_gpt_config.yaml"


def _cpu() -> DeviceCaps:
    from mixprec.device import device_caps

    return device_caps("cpu")


def _rules(path: Path, **kwargs: object) -> dict[str, str]:
    return {f.rule: f.severity for f in check_file(path, **kwargs)}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fixture", "scaling"),
    [
        (
            ACC / "test_configs__0_34_0_fp8.yaml",
            "Transformer Engine DelayedScaling (E4M3, amax_history_len 1024, "
            "amax_compute_algo max, margin 0)",
        ),
        (  # amax_compute_algo unset: TERecipeKwargs's default, most_recent
            ACC / "templates__fp8.yaml",
            "Transformer Engine DelayedScaling (E4M3, amax_history_len 1024, "
            "amax_compute_algo most_recent, margin 0)",
        ),
        (
            NEMO / "llm_finetune__gemma__gemma_2_9b_it_hellaswag_fp8.yaml",
            "torchao float8 tensorwise",
        ),
        (
            NEMO / "diffusion__finetune__flux_t2i_flow.yaml",
            "Transformer Engine DelayedScaling (amax_history_len 1024, amax_compute_algo max)",
        ),
    ],
)
def test_real_fp8_recipes_are_read_and_scale(fixture: Path, scaling: str) -> None:
    facts = load_config(fixture)
    assert facts.fp8_enabled and facts.fp8_scaling == scaling
    assert F8 not in _rules(fixture)


def test_a_real_fp8_recipe_on_a_cpu_is_emulated() -> None:
    found = {f.rule: f for f in check_file(ACC / "test_configs__0_34_0_fp8.yaml", device=_cpu())}
    fna = found[FNA]
    assert fna.severity == "info"
    assert "numerics" in fna.message and "not fp8 speed" in fna.message
    assert fna.evidence["fp8_fast"] is False


def test_nemo1_megatron_fp8_settings(tmp_path: Path) -> None:
    text = MEGATRON.read_text()
    assert load_config(MEGATRON).fp8_enabled is False  # fp8: False as shipped
    on = write(tmp_path, text.replace("  fp8: False #", "  fp8: True #"), "on.yaml")
    facts = load_config(on)
    assert facts.dialect == "lightning"
    assert facts.fp8_scaling == (
        "Transformer Engine DelayedScaling (HYBRID, amax_history_len 1024, "
        "amax_compute_algo max, margin 0)"
    )
    assert F8 not in _rules(on)
    no_format = text.replace("  fp8: False #", "  fp8: True #").replace(
        "  fp8_hybrid: True #", "  fp8_hybrid: False #"
    )
    bad = write(tmp_path, no_format, "bad.yaml")
    with pytest.raises(ValueError, match=r"model\.fp8.*fp8_hybrid: true"):
        load_config(bad)
    algo = write(
        tmp_path,
        text.replace("  fp8: False #", "  fp8: True #").replace(
            "fp8_amax_compute_algo: max", "fp8_amax_compute_algo: mean"
        ),
        "algo.yaml",
    )
    with pytest.raises(ValueError, match="unknown value 'mean'; valid: max, most_recent"):
        load_config(algo)


@pytest.mark.parametrize(
    ("fp8_config", "scaling"),
    [
        ("{backend: AO}", "torchao float8 tensorwise current scaling"),
        ("{backend: MSAMP, opt_level: O2}", "MS-AMP O2"),
        ("{backend: TE, use_mxfp8_block_scaling: true}", "Transformer Engine MXFP8BlockScaling"),
        (
            "{backend: TE, fp8_format: hybrid, amax_history_length: 16}",
            "fp8_config.amax_history_length is not read by accelerate launch",
        ),
    ],
)
def test_accelerate_fp8_backends(tmp_path: Path, fp8_config: str, scaling: str) -> None:
    path = write(tmp_path, f"mixed_precision: fp8\nfp8_config: {fp8_config}\n")
    facts = load_config(path)
    assert facts.fp8_scaling is not None and scaling in facts.fp8_scaling
    assert F8 not in _rules(path)


@pytest.mark.parametrize(
    ("fp8_config", "match"),
    [
        ("{backend: TE, fp8_format: E6M1}", "unknown value 'E6M1'; valid: HYBRID, E4M3, E5M2"),
        ("{backend: TE, amax_compute_algo: mean}", "valid: max, most_recent"),
        ("{backend: XLA}", "valid: TE, MSAMP, AO"),
    ],
)
def test_accelerate_refuses_what_accelerate_refuses(
    tmp_path: Path, fp8_config: str, match: str
) -> None:
    path = write(tmp_path, f"mixed_precision: fp8\nfp8_config: {fp8_config}\n")
    with pytest.raises(ValueError, match=match):
        load_config(path)


def test_nemo_recipes_are_checked_and_emulation_is_read(tmp_path: Path) -> None:
    gemma = (NEMO / "llm_finetune__gemma__gemma_2_9b_it_hellaswag_fp8.yaml").read_text()
    emulated = write(tmp_path, gemma.replace("emulate: false", "emulate: true"), "emu.yaml")
    found = {f.rule: f for f in check_file(emulated)}
    assert found[FNA].severity == "info"
    assert "fp8.emulate: true" in found[FNA].message
    assert found[FNA].where.endswith("fp8.emulate")
    bad = write(
        tmp_path, gemma.replace("recipe_name: tensorwise", "recipe_name: colwise"), "bad.yaml"
    )
    with pytest.raises(ValueError, match="valid: tensorwise, rowwise, rowwise_with_gw_hp"):
        load_config(bad)
    flux = (NEMO / "diffusion__finetune__flux_t2i_flow.yaml").read_text()
    current = write(tmp_path, flux.replace('"delayed"', '"current"'), "current.yaml")
    assert load_config(current).fp8_scaling == (
        "Transformer Engine Float8CurrentScaling (model.transformer_engine_fp8_recipe: current)"
    )
    unknown = write(tmp_path, flux.replace('"delayed"', '"block"'), "block.yaml")
    with pytest.raises(ValueError, match="accepts delayed, current or mxfp8"):
        load_config(unknown)


def test_torchtitan_float8_emulation_and_recipe_names(tmp_path: Path) -> None:
    base = (FIXTURES / "torchtitan" / "clean_fp8_rowwise.toml").read_text()
    assert FNA not in _rules(FIXTURES / "torchtitan" / "clean_fp8_rowwise.toml")
    emu = write(tmp_path, base + "emulate = true\n", "emu.toml")
    found = {f.rule: f for f in check_file(emu)}
    assert found[FNA].severity == "info"
    assert "[quantize.linear.float8] emulate = true" in found[FNA].message
    bad = write(tmp_path, base.replace('"rowwise"', '"colwise"'), "bad.toml")
    with pytest.raises(ValueError, match="valid: tensorwise, rowwise"):
        load_config(bad)


def test_fp8_without_a_recipe_still_fires() -> None:
    assert _rules(FIXTURES / "mixprec" / "fp8-without-scaling.yaml")[F8] == "error"
    assert _rules(FIXTURES / "nemo" / "fp8-without-scaling.yaml")[F8] == "error"


def test_a_mixprec_config_reads_its_policys_fp8(tmp_path: Path) -> None:
    """The spelling docs/fp8.md teaches (an fp8 preset, or precision.fp8) is FP8 with a
    recipe: emulated on a CPU, never fp8-without-scaling; a top-level fp8 section that
    contradicts it is refused."""
    preset = write(tmp_path, "precision:\n  preset: fp8_tensorwise\ndevice: cpu\n", "a.yaml")
    found = {f.rule: f for f in check_file(preset)}
    assert set(found) == {FNA} and found[FNA].severity == "info"
    assert "torchao float8 tensorwise" in found[FNA].message
    assert found[FNA].where.endswith("precision.preset")
    field = write(
        tmp_path,
        "precision:\n  preset: bf16_master\n  fp8: rowwise\n"
        "device: {type: cuda, name: A100, fp8_fast: false}\n",
        "b.yaml",
    )
    assert {f.rule: f.where for f in check_file(field)} == {FNA: f"{field}:3 precision.fp8"}
    agreeing = write(tmp_path, "precision:\n  preset: fp8_rowwise\nfp8:\n  enabled: true\n")
    assert F8 not in _rules(agreeing)
    facts = load_config(agreeing)
    assert facts.fp8_enabled and facts.fp8_scaling == "torchao float8 rowwise (current scaling)"
    contradicting = write(
        tmp_path, "precision:\n  preset: fp8_rowwise\nfp8:\n  enabled: true\n  scaling: delayed\n"
    )
    with pytest.raises(ValueError, match=r"says scaling 'delayed', but .* trains fp8 'rowwise'"):
        load_config(contradicting)


def test_a_live_check_of_an_fp8_policy_without_a_model() -> None:
    from mixprec import doctor

    found = {f.rule: f for f in doctor.check(policy="fp8_tensorwise", device="cpu")}
    assert set(found) == {FNA} and "torchao float8 tensorwise" in found[FNA].message
    assert doctor.check(policy="bf16_master", device="cpu") == []
