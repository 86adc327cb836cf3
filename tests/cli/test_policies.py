"""`mixprec policies --probe`: measured choices (with a fake timer), the cache, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mixprec
from mixprec.cli import main
from mixprec.speed import Step, StepTimer


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MIXPREC_SPEED_CACHE", raising=False)
    return tmp_path / "cache" / "speed"


def _fake_clock(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[str]:
    calls: list[str] = []

    def factory(device: object = "cpu", **_: object) -> StepTimer:
        def timer(name: str, step: Step) -> float:
            step()
            calls.append(name)
            return seconds[name]

        return timer

    monkeypatch.setattr("mixprec.speed.measure.wall_clock_timer", factory)
    return calls


def test_probe_picks_fp32_for_a_workload_where_bf16_is_slower(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_clock(monkeypatch, {"fp32": 0.010, "bf16": 0.0241, "fp16": 0.1})
    argv = ["policies", "--probe", "--workload", "shakespeare", "--size", "tiny", "--repeats", "2"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "timing shakespeare tiny" in captured.err
    out = captured.out
    assert "auto      -> fp32: auto chose fp32 on " in out
    assert "bf16 autocast step 2.41x fp32's (median 2.41x)" in out
    # fp16 is timed too where this CPU computes it fast (avx512_fp16, AMX-FP16)
    fp16_timed = mixprec.device_caps("cpu").fp16_fast
    assert ("fp16 autocast step 10.00x fp32's (median 10.00x)" in out) == fp16_timed
    assert "on this CPU at these shapes" in out
    assert "(shakespeare tiny: GPT" in out and "best and median of 2 interleaved steps" in out
    assert "cache: miss" in out
    lines = {
        line.split()[0]: line.split() for line in out.splitlines() if line[:4] in ("fp32", "bf16")
    }
    assert lines["fp32"][1:] == ["10.0", "10.0", "1.00x", "1.00x"]
    assert lines["bf16"][1:] == ["24.1", "24.1", "2.41x", "2.41x"]


def test_probe_picks_bf16_for_large_shapes_where_bf16_is_faster(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], private_cache: Path
) -> None:
    calls = _fake_clock(monkeypatch, {"fp32": 4.0, "bf16": 1.8, "fp16": 9.0})
    argv = ["policies", "--probe", "--shape", "256x128x64", "--shape", "32x32x32", "--json"]
    assert main(argv) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["resolves_to"] == "amp_bf16" and auto["source"] == "measured"
    assert "bf16 autocast step 0.45x fp32's" in auto["reason"]
    assert "matmuls 256x128x64,32x32x32" in auto["reason"]
    assert auto["measured"]["choice"] == "bf16" and auto["measured"]["cache"] == "miss"
    assert [p.suffix for p in private_cache.iterdir()] == [".json"]
    calls.clear()
    assert main(argv) == 0, "the second run reads the cache"
    assert json.loads(capsys.readouterr().out)["auto"]["measured"]["cache"] == "hit"
    assert calls == []
    assert main([*argv, "--cache", "refresh"]) == 0
    assert json.loads(capsys.readouterr().out)["auto"]["measured"]["cache"] == "refresh"
    assert calls


def test_cache_off_measures_and_stores_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], private_cache: Path
) -> None:
    _fake_clock(monkeypatch, {"fp32": 1.0, "bf16": 2.0, "fp16": 3.0})
    assert main(["policies", "--probe", "--shape", "8x8x8", "--cache", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["auto"]["measured"]["cache"] == "off"
    assert not private_cache.exists()


def test_without_probe_auto_says_it_read_device_facts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["source"] == "device facts" and auto["measured"] is None
    assert "from device facts, nothing measured" in auto["reason"]
    assert main(["policies"]) == 0
    assert "`mixprec policies --probe` measures this machine" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--probe", "--shape", "4096x4096"], "bad matmul shape '4096x4096': give MxNxK"),
        (["--probe", "--shape", "abc"], "bad matmul shape 'abc'"),
        (["--probe", "--shape", "0x64x64"], "bad matmul shape '0x64x64': matmul dimension m"),
        (["--probe", "--shape", "64x64x64,"], "bad matmul shape ''"),
        (["--probe", "--shape", "8x8x8", "--workload", "digits"], "not both"),
        (["--shape", "8x8x8"], "--shape: only with --probe"),
        (["--workload", "digits", "--cache", "off"], "--workload, --cache: only with --probe"),
        (["--probe", "--repeats", "0"], "--repeats must be >= 1"),
        (["--probe", "--repeats", "1001"], "--repeats must be >= 1 and <= 1000, got 1001"),
        (["--probe", "--shape", "-4x4x4"], "a value starting with '-' is written --option=VALUE"),
        (["--probe", "--shape=-4x4x4"], "bad matmul shape '-4x4x4'"),
        (["--probe", "--cache", "maybe"], "invalid choice: 'maybe'"),
        (["--probe", "--workload", "nope"], "unknown workload 'nope'"),
        (["--probe", "--shape", "8x8x8", "--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _fake_clock(monkeypatch, {"fp32": 1.0, "bf16": 1.0, "fp16": 1.0})
    assert main(["policies", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("mixprec"), captured.err
    assert message in captured.err
    assert captured.out == "" and calls == []


def test_the_fp8_presets_are_listed_with_their_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies", "--json"]) == 0
    presets = {p["name"]: p for p in json.loads(capsys.readouterr().out)["presets"]}
    assert presets["fp8_rowwise_gw_hp"]["fp8"] == {
        "recipe": "rowwise_with_gw_hp",
        "emulate": None,
        "min_divisor": 16,
        "skip_first_last": True,
        "exclude": [],
    }
    assert presets["fp8_tensorwise"]["param_dtype"] == "bf16"
    assert presets["fp8_tensorwise"]["master"] == "exact"
    assert presets["bf16_master"]["fp8"] is None
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["preset"][-2:] == ["fp8", "release"]
    assert rows["fp8_rowwise"][-2] == "rowwise" and rows["bf16_master"][-2:] == ["-", "-"]
    assert "fp8       the eligible nn.Linear layers train in FP8 through torchao" in out


def test_the_first_ctrl_c_stops_the_probe_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], private_cache: Path
) -> None:
    from mixprec.cli.interrupt import INTERRUPTED

    calls: list[str] = []

    def factory(device: object = "cpu", **_: object) -> StepTimer:
        def timer(name: str, step: Step) -> float:
            calls.append(name)
            INTERRUPTED.set()  # what the first Ctrl-C does (cooperative_sigint)
            return 1.0

        return timer

    monkeypatch.setattr("mixprec.speed.measure.wall_clock_timer", factory)
    assert main(["policies", "--probe", "--shape", "8x8x8", "--repeats", "50"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("mixprec: interrupted")
    assert len(calls) == 1, "stopped at the next step, not after 100+ more"
    assert not private_cache.exists() or not any(private_cache.iterdir())
