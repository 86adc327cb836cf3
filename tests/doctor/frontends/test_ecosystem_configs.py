"""HF Trainer/TRL and DeepSpeed configs, real (vendored, see each SOURCES.md) and
constructed: the format each is detected as and exactly the findings it gets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mixprec.doctor import check_file, load_config
from mixprec.doctor.frontends import check_config, read_config

from .cases import FIXTURES, write

E, W = "error", "warning"
OS16 = "optimizer-state-16bit"
RD16 = "reduce-dtype-16bit"

# (format, fixture, {rule: severity}): what each file should get, from the semantics in
# docs/doctor.md ("HF Trainer / TRL recipes", "DeepSpeed JSON").
EXPECTED: list[tuple[str, str, dict[str, str]]] = [
    # alignment-handbook recipes (real)
    ("hf", "constitutional-ai__dpo__config_anthropic.yaml", {}),  # dtype null -> fp32; rmsprop
    ("hf", "pref_align_scan__dpo__config_zephyr.yaml", {}),  # dtype null -> fp32 + bf16 AMP
    ("hf", "zephyr-7b-beta__dpo__config_full.yaml", {}),  # dtype null -> fp32 + bf16 AMP
    ("hf", "smollm2__dpo__config.yaml", {OS16: E}),  # bf16 weights, adamw_torch
    ("hf", "smollm2__sft__config_smol.yaml", {OS16: E}),  # bf16 weights, default optim
    ("hf", "smollm3__dpo__apo.yaml", {OS16: E}),
    ("hf", "smollm__sft__config.yaml", {OS16: E}),
    ("hf", "starchat2-15b__dpo__config_v0.1.yaml", {OS16: E}),
    ("hf", "zephyr-141b-A35b__orpo__config_full.yaml", {OS16: E}),  # adamw_bnb_8bit, no master
    ("hf", "zephyr-7b-beta__sft__config_full.yaml", {OS16: E}),
    ("hf", "zephyr-7b-gemma__sft__config_full.yaml", {OS16: E}),
    ("hf", "zephyr-7b-beta__dpo__config_qlora.yaml", {OS16: W}),  # QLoRA: bf16 adapters
    ("hf", "zephyr-7b-beta__sft__config_qlora.yaml", {OS16: W}),
    # constructed
    ("hf", "optimizer-state-16bit.yaml", {OS16: E}),
    ("hf", "optimizer-state-16bit-short.yaml", {OS16: W}),
    # optim: sgd over fp16 weights rounds every update (a short run: a warning)
    ("hf", "fp16-without-loss-scaling.yaml", {"fp16-without-loss-scaling": E, OS16: W}),
    ("hf", "clean_amp_bf16.yaml", {}),
    ("hf", "clean_amp_fp16.yaml", {}),
    ("hf", "clean_lora_bf16.yaml", {}),
    ("hf", "clean_deepspeed.yaml", {}),
    ("hf", "clean_fsdp.yaml", {}),
    # DeepSpeedExamples configs (real)
    ("deepspeed", "BingBertGlue__glue_bert_base.json", {}),  # fp32
    ("deepspeed", "autotuning__hf__dsconfigs__ds_config_z3.json", {}),  # fp32, ZeRO-3
    ("deepspeed", "data_efficiency__vit_finetuning__config__ds_config_cifar_random_ltd.json", {}),
    ("deepspeed", "imagenet__config__ds_config.json", {}),  # fp32; tab-indented JSON
    ("deepspeed", "tensor_parallel__hf_integration__configs__ds_config.json", {}),  # bf16 "auto"
    ("deepspeed", "BingBertSquad__deepspeed_bsz24_config.json", {RD16: W}),  # fp16 comm default
    ("deepspeed", "MoQ__test.json", {RD16: W}),
    ("deepspeed", "autotuning__hf__dsconfigs__ds_config_fp16_z2.json", {RD16: W}),
    (
        "deepspeed",
        "bing_bert__01_adam__nccl__deepspeed_bsz4k_01adam_config_seq128_nccl.json",
        {RD16: W},
    ),
    ("deepspeed", "bing_bert__deepspeed_bsz64k_lamb_config_seq128.json", {RD16: W}),
    ("deepspeed", "imagenet__config__ds_fp16_z1_config.json", {RD16: W}),
    ("deepspeed", "DeepSpeed-ZenFlow__finetuning__zf_config.json", {RD16: W}),  # bf16 comm default
    ("deepspeed", "bf16_master_weight__configs__baseline.json", {RD16: W}),
    ("deepspeed", "bf16_master_weight__configs__bf16_full.json", {OS16: E, RD16: W}),
    # constructed
    ("deepspeed", "reduce-dtype-16bit.json", {RD16: W}),
    ("deepspeed", "fp16-without-loss-scaling.json", {"fp16-without-loss-scaling": E}),
    ("deepspeed", "optimizer-state-16bit.json", {OS16: E}),
    ("deepspeed", "clean_bf16_fp32_reduce.json", {}),
    ("deepspeed", "clean_fp16_dynamic.json", {}),
]


@pytest.mark.parametrize(("fmt", "name", "expected"), EXPECTED)
def test_config_gets_exactly_its_findings(fmt: str, name: str, expected: dict[str, str]) -> None:
    got_format, _, findings = check_config(read_config(FIXTURES / fmt / name))
    assert got_format == fmt
    assert {f.rule: f.severity for f in findings} == expected
    assert len(findings) == len(expected)


def test_every_vendored_fixture_is_judged() -> None:
    listed = {(fmt, name) for fmt, name, _ in EXPECTED}
    for fmt in ("hf", "deepspeed"):
        on_disk = {(fmt, p.name) for p in (FIXTURES / fmt).iterdir() if p.suffix != ".md"}
        assert on_disk == {x for x in listed if x[0] == fmt}


def test_hf_bf16_adamw_evidence_and_location() -> None:
    path = FIXTURES / "hf" / "optimizer-state-16bit.yaml"
    (f,) = check_file(path)
    assert f.evidence["param_dtype"] == "bf16" and f.evidence["moments"] == "bf16"
    assert f.evidence["master"] == "none" and f.evidence["steps"] == 20000
    assert "DeepSpeed" in f.evidence["optimizer_note"]  # judged as written, says so
    assert f.where == f"{path}:6 optim"


def test_hf_unset_and_auto_dtypes_say_how_they_were_decided(tmp_path: Path) -> None:
    facts = load_config(write(tmp_path, "model_name_or_path: m\nbf16: true\n"))
    assert str(facts.param_dtype) == "fp32" and "TRL" in facts.param_dtype_note
    auto = write(tmp_path, "model_name_or_path: m\ntorch_dtype: auto\nmax_steps: 50000\n", "a.yaml")
    (f,) = check_file(auto)
    assert f.rule == OS16 and "taken as bf16" in f.evidence["param_dtype_source"]


def test_hf_quantized_lora_trains_bf16_adapters_as_peft() -> None:
    facts = load_config(FIXTURES / "hf" / "zephyr-7b-beta__sft__config_qlora.yaml")
    assert facts.peft and str(facts.param_dtype) == "bf16"
    assert "quantized" in facts.param_dtype_note


def test_hf_bad_values_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"max_steps: must be an integer"):
        check_file(write(tmp_path, "model_name_or_path: m\nmax_steps: many\n"))
    with pytest.raises(ValueError, match=r"torch_dtype.*unknown dtype"):
        check_file(write(tmp_path, "model_name_or_path: m\ntorch_dtype: float99\n", "b.yaml"))


def test_deepspeed_reduce_default_follows_the_training_dtype() -> None:
    (f,) = check_file(FIXTURES / "deepspeed" / "MoQ__test.json")
    assert f.evidence["reduce_dtype"] == "fp16"
    assert "communication_data_type unset" in f.evidence["reduce_dtype_source"]


def test_deepspeed_bf16_masters_are_located(tmp_path: Path) -> None:
    path = FIXTURES / "deepspeed" / "bf16_master_weight__configs__bf16_full.json"
    os16 = next(f for f in check_file(path) if f.rule == OS16)
    assert os16.evidence["master"] == "none" and os16.evidence["moments"] == "bf16"
    assert "bf16.bf16_master_weights_and_grads" in os16.where


def test_deepspeed_static_scales(tmp_path: Path) -> None:
    base = '{"train_batch_size": 8, "communication_data_type": "fp32", "fp16": '
    scaled = write(tmp_path, base + '{"enabled": true, "loss_scale": 1024}}', "s.json")
    assert check_file(scaled) == []
    with pytest.raises(ValueError, match=r"fp16.loss_scale: must be a number"):
        check_file(write(tmp_path, base + '{"enabled": true, "loss_scale": "x"}}', "x.json"))


def test_nothing_named_is_imported(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model_name_or_path: m\ntorch_dtype: bfloat16\noptim: mixprec_never_imported.Opt\n",
    )
    assert check_file(path) == []  # not on the allowlist: not judged
    assert not any(m.startswith("mixprec_never") for m in sys.modules)


def test_every_hf_optimizer_finding_says_it_was_judged_as_written(tmp_path: Path) -> None:
    """A recipe is judged as written; the launcher (Accelerate DeepSpeed/FSDP) may keep
    fp32 masters, and every HF optimizer-state-16bit finding says so."""
    constructed = {
        "no_amp.yaml": "model_name_or_path: m\ntorch_dtype: bfloat16\n",
        "fsdp_no_amp.yaml": "model_name_or_path: m\ntorch_dtype: bfloat16\nfsdp: full_shard\n",
        "ds_no_amp.yaml": "model_name_or_path: m\ntorch_dtype: bfloat16\ndeepspeed: ds.json\n",
    }
    paths = [FIXTURES / "hf" / name for fmt, name, _ in EXPECTED if fmt == "hf"]
    paths += [write(tmp_path, text, name) for name, text in constructed.items()]
    seen = 0
    for path in paths:
        for f in check_file(path):
            if f.rule == OS16:
                seen += 1
                assert "judged as written" in f.evidence.get("optimizer_note", ""), path.name
    assert seen == 16  # 13 vendored/constructed fixtures and the 3 above
