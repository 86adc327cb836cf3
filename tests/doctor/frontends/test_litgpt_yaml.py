"""LitGPT configs, real (vendored, see fixtures/litgpt/SOURCES.md) and constructed:
detected as ``litgpt`` and given exactly their findings."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.device import DeviceCaps
from mixprec.doctor import check_file, detect_format, load_config
from mixprec.doctor.frontends import check_config, read_config

from .cases import FIXTURES, write

E, W = "error", "warning"
OS16 = "optimizer-state-16bit"
RD16 = "reduce-dtype-16bit"
FP16 = "fp16-without-loss-scaling"
LIT = FIXTURES / "litgpt"

# Semantics (LitGPT 26857050fe3f, Fabric 7f0c3436cd3f): finetune/full.py and pretrain.py
# build FSDPStrategy when devices x num_nodes > 1 (FSDPPrecision: bf16-true creates the
# model in bf16 and reduces in bf16, bf16-mixed keeps fp32 weights and reduces in bf16);
# one device: HalfPrecision (bf16-true casts, no fp32 copy). finetune/lora.py creates the
# LoRA weights under fabric.init_module (bf16 under bf16-true); with quantize it swaps in
# bitsandbytes PagedAdamW (32-bit state, no master). max_steps unset: bounded by epochs.
EXPECTED: dict[str, tuple[dict[str, str], str]] = {
    "finetune__llama-3.2-1B__full.yaml": (
        {OS16: E},
        "bf16-true on 1 device: bf16 weights, torch AdamW state bf16; max_steps unset",
    ),
    "finetune__tiny-llama__full.yaml": ({OS16: E}, "as llama-3.2-1B full"),
    "finetune__phi-3__full.yaml": (
        {OS16: E},
        "bf16-true, devices 1; num_nodes: null taken as setup()'s default 1",
    ),
    "finetune__llama-2-7b__full.yaml": (
        {OS16: E, RD16: W},
        "devices 4: FSDPStrategy, bf16-true creates bf16 flat params, reduce_dtype bf16",
    ),
    "finetune__stablelm-base-alpha-3b__full.yaml": (
        {OS16: E, RD16: W},
        "devices 2: as llama-2-7b full",
    ),
    "finetune__gemma-2b__full.yaml": (
        {OS16: W, RD16: W},
        "devices 4, FSDP bf16-true; max_steps 50 (short)",
    ),
    "finetune__phi-2__full.yaml": (
        {OS16: W, RD16: W},
        "devices 2, FSDP bf16-true; max_steps 100 (short)",
    ),
    "finetune__llama-3.2-1B__lora.yaml": (
        {OS16: W},
        "bf16-true: LoRA A/B created in bf16; torch AdamW over them; only adapters train",
    ),
    "finetune__mistral-7b__lora.yaml": ({OS16: W}, "as llama-3.2-1B lora"),
    "finetune__gemma-2b__lora.yaml": ({OS16: W}, "as llama-3.2-1B lora"),
    "finetune__llama-3.2-1B__qlora.yaml": (
        {OS16: W},
        "quantize bnb.nf4: BitsandbytesPrecision bf16 adapters, PagedAdamW (fp32 state, no master)",
    ),
    "finetune__falcon-7b__qlora.yaml": ({OS16: W}, "as llama-3.2-1B qlora"),
    "pretrain__tinyllama.yaml": (
        {RD16: W},
        "bf16-mixed: fp32 weights and state; devices auto: FSDPStrategy on more than one "
        "GPU reduces in bf16",
    ),
    "pretrain__debug.yaml": ({RD16: W}, "as tinyllama"),
}


@pytest.mark.parametrize(("name", "expected"), sorted((k, v[0]) for k, v in EXPECTED.items()))
def test_config_gets_exactly_its_findings(name: str, expected: dict[str, str]) -> None:
    got_format, _, findings = check_config(read_config(LIT / name))
    assert got_format == "litgpt"
    assert {f.rule: f.severity for f in findings} == expected
    assert len(findings) == len(expected)


def test_every_fixture_is_judged() -> None:
    assert {p.name for p in LIT.glob("*.yaml")} == set(EXPECTED)
    assert "26857050fe3ff627cd714fe92f5838f51a3d5efa" in (LIT / "SOURCES.md").read_text()


def test_a_full_bf16_true_finetune_points_at_precision() -> None:
    (f,) = check_file(LIT / "finetune__llama-3.2-1B__full.yaml")
    assert f.where.endswith(".yaml:8 precision") and "bf16-mixed" in f.fix
    assert f.evidence["moments"] == "bf16" and f.evidence["steps"] is None


def test_qlora_trains_paged_adamw_over_bf16_adapters() -> None:
    facts = load_config(LIT / "finetune__llama-3.2-1B__qlora.yaml")
    assert facts.peft and facts.optimizer is not None
    assert facts.optimizer.name == "bitsandbytes.optim.PagedAdamW"
    (group,) = facts.optimizer.groups
    assert (str(group.param_dtype), group.master, group.moments) == (
        "bf16",
        "none",
        "fp32",
    )


def test_pretrain_on_auto_devices_says_the_world_size_is_unknown() -> None:
    facts = load_config(LIT / "pretrain__tinyllama.yaml")
    assert str(facts.param_dtype) == "fp32" and "devices: auto" in facts.reduce_note


BASE = "checkpoint_dir: checkpoints/m\ntrain:\n  global_batch_size: 8\n  max_steps: 5000\n"


def test_precision_spellings(tmp_path: Path) -> None:
    fp16 = check_file(write(tmp_path, BASE + "precision: 16-true\n"))
    assert {f.rule for f in fp16} == {FP16, OS16}
    assert check_file(write(tmp_path, BASE + "precision: bf16-mixed\n", "m.yaml")) == []
    assert check_file(write(tmp_path, BASE + "precision: '16'\n", "l.yaml")) == []  # 16-mixed
    with pytest.raises(ValueError, match=r"precision: unknown precision 'fp8'"):
        check_file(write(tmp_path, BASE + "precision: fp8\n", "x.yaml"))


def test_unset_precision_follows_the_device(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    assert check_file(path) == [] and "bf16-mixed" in load_config(path).param_dtype_note
    v100 = DeviceCaps(
        device_type="cuda",
        name="Tesla V100",
        bf16_supported=False,
        fp16_supported=True,
        bf16_fast=False,
        fp16_fast=True,
        bf16_reason="pre-Ampere",
        fp16_reason="tensor cores",
    )
    facts = load_config(path, device=v100)
    assert facts.loss_scaling is True and str(facts.compute_dtype) == "fp16"


def test_optimizers_outside_torch_adam_are_not_judged(tmp_path: Path) -> None:
    text = BASE + "precision: bf16-true\noptimizer:\n  class_path: grokadamw.GrokAdamW\n"
    assert check_file(write(tmp_path, text)) == []
    sgd = BASE + "precision: bf16-true\noptimizer: SGD\n"
    assert load_config(write(tmp_path, sgd, "s.yaml")).optimizer.state == ()  # type: ignore[union-attr]


def test_quantize_with_mixed_precision_is_refused(tmp_path: Path) -> None:
    text = BASE + "lora_r: 8\nquantize: bnb.nf4\nprecision: bf16-mixed\n"
    with pytest.raises(ValueError, match=r"quantize: LitGPT refuses"):
        check_file(write(tmp_path, text))
    fp32 = BASE + "lora_r: 8\nquantize: bnb.nf4\nprecision: 32-true\n"
    assert check_file(write(tmp_path, fp32, "f.yaml")) == []


def test_lora_on_several_devices_reduces_in_the_adapters_dtype(tmp_path: Path) -> None:
    text = BASE + "lora_r: 8\nprecision: bf16-true\ndevices: 2\n"
    rules = {f.rule: f.severity for f in check_file(write(tmp_path, text))}
    assert rules == {OS16: W, RD16: W}
    mixed = text.replace("bf16-true", "bf16-mixed")
    assert check_file(write(tmp_path, mixed, "m.yaml")) == []  # fp32 adapters, fp32 reduce


def test_detection_keeps_litgpt_and_lightning_apart() -> None:
    assert detect_format({"checkpoint_dir": "c", "train": {"max_steps": 1}}) == "litgpt"
    assert detect_format({"model_name": "pythia", "train": {"epochs": 1}}) == "litgpt"
    lightning = {"trainer": {"precision": "bf16-true"}, "train": {"max_steps": 1}}
    assert detect_format({**lightning, "checkpoint_dir": "c"}) == "lightning"
