"""TrainSettings: validation, overrides, the schedule, and the presets that compose it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mixprec.workloads import (
    DIGITS_SIZES,
    SHAKESPEARE_SIZES,
    DigitsConfig,
    ShakespeareConfig,
    TrainDefaults,
    TrainSettings,
    load_workload,
    lr_at,
)

DEFAULTS = TrainSettings(
    steps=10,
    batch_size=4,
    lr=1e-3,
    min_lr=1e-4,
    warmup_steps=2,
    weight_decay=0.0,
    grad_clip_norm=None,
)


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"steps": 0}, "steps must be a positive int .*got 0"),
        ({"steps": True}, "steps must be a positive int .*got True"),
        ({"batch_size": 2.0}, "batch_size must be a positive int .*got 2.0"),
        ({"warmup_steps": 11}, r"warmup_steps must be an int in \[0, steps=10\], got 11"),
        ({"warmup_steps": -1}, "warmup_steps must be an int >= 0 .*got -1"),
        ({"lr": 0.0}, r"lr must be a finite number > 0 \(the peak .*got 0.0"),
        ({"lr": math.inf}, "lr must be a finite number > 0 .*got inf"),
        ({"lr": "1e-3"}, "lr must be a number, got '1e-3'"),
        ({"min_lr": 1.0}, r"min_lr \(1\) must not exceed lr \(0.001\): .*lower min_lr or raise lr"),
        ({"min_lr": -1e-5}, "min_lr must be a finite number >= 0 .*got -1e-05"),
        ({"weight_decay": -1.0}, "weight_decay must be a finite number >= 0 .*got -1.0"),
        ({"grad_clip_norm": 0.0}, r"grad_clip_norm must be a number > 0 .* or None .*got 0.0"),
        ({"grad_clip_norm": math.nan}, "grad_clip_norm must be a number > 0 .*got nan"),
        ({"betas": (0.9,)}, r"betas must be two numbers in \[0, 1\) .*got \(0.9,\)"),
        ({"betas": (0.9, 1.0)}, r"betas must be two numbers in \[0, 1\) .*got \(0.9, 1.0\)"),
    ],
)
def test_settings_validate_naming_the_value(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(DEFAULTS, **changes)


def test_settings_normalize_freeze_and_round_trip_through_json() -> None:
    settings = TrainSettings(
        steps=5,
        batch_size=2,
        lr=1,
        min_lr=0,
        warmup_steps=0,
        weight_decay=0,
        grad_clip_norm=math.inf,
        betas=[0.8, 0.9],  # type: ignore[arg-type]
    )
    assert (settings.lr, settings.min_lr, settings.weight_decay) == (1.0, 0.0, 0.0)
    assert all(isinstance(v, float) for v in (settings.lr, settings.min_lr, settings.weight_decay))
    assert settings.betas == (0.8, 0.9) and settings.grad_clip_norm == math.inf
    assert DEFAULTS.betas == (0.9, 0.99)  # AdamW's betas unless a workload says otherwise
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.lr = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainSettings(1, 2, 3, 4, 5, 6, 7)  # type: ignore[misc]  # keyword-only
    data = json.loads(json.dumps(DEFAULTS.to_dict()))
    assert data["betas"] == [0.9, 0.99] and TrainSettings(**data) == DEFAULTS


def test_train_defaults_is_the_former_name() -> None:
    assert TrainDefaults is TrainSettings


# ------------------------------------------------------------- overrides


def test_overrides_win_and_the_rest_is_kept() -> None:
    out = DEFAULTS.with_overrides({"lr": 2e-3, "steps": 20, "batch_size": None})
    assert (out.lr, out.steps, out.batch_size) == (2e-3, 20, DEFAULTS.batch_size)
    assert dataclasses.replace(out, lr=DEFAULTS.lr, steps=DEFAULTS.steps) == DEFAULTS
    assert DEFAULTS.with_overrides({}) == DEFAULTS
    assert DEFAULTS.with_overrides({"betas": [0.9, 0.95]}).betas == (0.9, 0.95)


def test_overrides_clamp_warmup_to_the_run() -> None:
    assert DEFAULTS.with_overrides({"steps": 1}).warmup_steps == 1
    assert DEFAULTS.with_overrides({"warmup_steps": 50}).warmup_steps == DEFAULTS.steps
    assert DEFAULTS.with_overrides({"steps": 3, "warmup_steps": 2}).warmup_steps == 2


def test_overrides_refuse_unknown_names_bad_values_and_a_rising_schedule() -> None:
    with pytest.raises(
        ValueError, match=r"unknown training setting\(s\) 'stepz'; valid: steps, batch_size, lr"
    ):
        DEFAULTS.with_overrides({"stepz": 3})
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0 .*got -1"):
        DEFAULTS.with_overrides({"lr": -1})
    with pytest.raises(ValueError, match=r"min_lr \(0.01\) must not exceed lr \(0.001\)"):
        DEFAULTS.with_overrides({"lr": 1e-3, "min_lr": 1e-2})
    # One side overridden, the other a default: the message says which and how to fix it.
    with pytest.raises(
        ValueError,
        match=r"min_lr 0.0001 exceeds lr 1e-05 \(overriding one, min_lr kept its default "
        r"0.0001\): the schedule would rise; override both",
    ):
        DEFAULTS.with_overrides({"lr": 1e-5})
    with pytest.raises(ValueError, match=r"lr kept its default 0.001\).*override both"):
        DEFAULTS.with_overrides({"min_lr": 1e-2})
    with pytest.raises(ValueError, match="training overrides must be a mapping"):
        TrainSettings.check_overrides([("lr", 1e-3)])  # type: ignore[arg-type]


def test_check_overrides_normalizes_and_drops_none() -> None:
    checked = TrainSettings.check_overrides(
        {"lr": 1, "steps": 7, "grad_clip_norm": None, "betas": [0.9, 0.95]}
    )
    assert checked == {"lr": 1.0, "steps": 7, "betas": (0.9, 0.95)}
    assert isinstance(checked["lr"], float)


# -------------------------------------------------------------- schedule


def test_lr_at_warms_up_linearly_then_decays_by_cosine() -> None:
    s = DEFAULTS  # steps 10, warmup 2, lr 1e-3 -> min_lr 1e-4
    assert lr_at(0, s) == 1e-3 * 1 / 2 and lr_at(1, s) == 1e-3
    for step in range(2, 15):
        progress = min((step - 2) / 8, 1.0)
        expected = 1e-4 + 0.5 * (1 + math.cos(math.pi * progress)) * (1e-3 - 1e-4)
        assert lr_at(step, s) == pytest.approx(expected, rel=1e-15, abs=0)
    assert lr_at(2, s) == pytest.approx(1e-3) and lr_at(6, s) == pytest.approx(5.5e-4)
    assert lr_at(10, s) == 1e-4 and lr_at(100, s) == 1e-4
    decay = [lr_at(step, s) for step in range(2, 11)]
    assert decay == sorted(decay, reverse=True)
    no_warmup = dataclasses.replace(s, warmup_steps=0)
    assert lr_at(0, no_warmup) == 1e-3
    one_step = dataclasses.replace(s, steps=1, warmup_steps=1)
    assert lr_at(0, one_step) == 1e-3 and lr_at(1, one_step) == pytest.approx(1e-3)


# ------------------------------------------------- presets compose settings

#: The training settings of every preset, as they were before presets composed a
#: `TrainSettings`: runs of these sizes must stay exactly what they were.
PRESET_TRAIN = {
    ("digits", "tiny"): (50, 32, 1e-2, 1e-3, 5, 0.01, 1.0),
    ("digits", "default"): (300, 64, 3e-3, 3e-4, 20, 0.01, 1.0),
    ("shakespeare", "tiny"): (50, 16, 1e-2, 1e-3, 5, 0.1, 1.0),
    ("shakespeare", "small"): (500, 32, 3e-3, 3e-4, 50, 0.1, 1.0),
    ("shakespeare", "compare"): (500, 32, 1e-3, 1e-4, 25, 0.1, 1.0),
    ("shakespeare", "default"): (2000, 32, 2e-3, 2e-4, 100, 0.1, 1.0),
}


@pytest.mark.parametrize(("workload", "size"), list(PRESET_TRAIN))
def test_presets_hold_their_training_settings_unchanged(workload: str, size: str) -> None:
    sizes = DIGITS_SIZES if workload == "digits" else SHAKESPEARE_SIZES
    steps, batch, lr, min_lr, warmup, decay, clip = PRESET_TRAIN[(workload, size)]
    assert sizes[size].train == TrainSettings(
        steps=steps,
        batch_size=batch,
        lr=lr,
        min_lr=min_lr,
        warmup_steps=warmup,
        weight_decay=decay,
        grad_clip_norm=clip,
        betas=(0.9, 0.99),
    )


def test_a_workload_config_composes_settings_instead_of_copying_them() -> None:
    train_fields = {f.name for f in dataclasses.fields(TrainSettings)}
    for config in (DigitsConfig, ShakespeareConfig):
        own = {f.name for f in dataclasses.fields(config)}
        assert "train" in own and not own & train_fields, config
    with pytest.raises(TypeError, match="train must be a TrainSettings, got dict"):
        DigitsConfig(train={"steps": 3})  # type: ignore[arg-type]


def test_workload_overrides_reach_its_settings_and_its_record() -> None:
    tiny = DIGITS_SIZES["tiny"].train
    wl = load_workload("digits", size="tiny", steps=20, lr=5e-3, hidden_sizes=(8,))
    assert wl.defaults == dataclasses.replace(tiny, steps=20, lr=5e-3)
    assert wl.config["steps"] == 20 and wl.config["lr"] == 5e-3 and "train" not in wl.config
    assert wl.config["hidden_sizes"] == (8,) and wl.config["betas"] == (0.9, 0.99)
    whole = dataclasses.replace(tiny, batch_size=8)
    assert load_workload("digits", size="tiny", train=whole, steps=9).defaults == (
        dataclasses.replace(whole, steps=9)
    )
    with pytest.raises(ValueError, match=r"warmup_steps must be an int in \[0, steps=50\]"):
        load_workload("digits", size="tiny", warmup_steps=60)
    with pytest.raises(ValueError, match=r"unknown digits option\(s\) 'stepz'; valid: .*steps"):
        load_workload("digits", size="tiny", stepz=3)
