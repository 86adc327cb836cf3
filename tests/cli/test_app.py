from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from mixprec.cli import build_parser, main
from mixprec.dtypes import FORMAT_NAMES
from mixprec.policy import PRESET_NAMES

# The command line is contract: subcommands and their flags. Adding one is a decision;
# update this pin together with docs/cli.md.
PINNED: dict[str, set[str]] = {
    "formats": {"--json"},
    "policies": {
        "--probe",
        "--workload",
        "--size",
        "--shape",
        "--device",
        "--repeats",
        "--cache",
        "--json",
    },
    "budget": {
        "--params",
        "--config",
        "--model",
        "--policy",
        "--world-size",
        "--sharding",
        "--seq-len",
        "--micro-batch",
        "--activations",
        "--device",
        "--grad-accum-dtype",
        "--optimizer",
        "--optimizer-args",
        "--json",
    },
    "compare": {
        "--workload",
        "--size",
        "--baseline",
        "--policies",
        "--steps",
        "--seeds",
        "--max-seeds",
        "--max-rel-loss-gap",
        "--allow",
        "--lr",
        "--min-lr",
        "--batch-size",
        "--objective",
        "--memory-budget",
        "--max-slowdown",
        "--target-device",
        "--baseline-for-fp8",
        "--optimizer",
        "--optimizer-args",
        "--config",
        "--out",
        "--device",
        "--track",
        "--track-uri",
        "--quiet",
        "--json",
    },
    "train": {
        "--config",
        "--workload",
        "--size",
        "--policy",
        "--policy-from",
        "--steps",
        "--seed",
        "--optimizer",
        "--optimizer-args",
        "--out",
        "--save-every",
        "--eval-every",
        "--stop-after",
        "--resume",
        "--device",
        "--nproc",
        "--strategy",
        "--track",
        "--track-uri",
        "--json",
    },
    "report": {"--json"},
    "doctor": {"--json", "--output", "--format", "--skip-unknown"},
}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_cli_surface_is_pinned() -> None:
    subs = _subcommands(build_parser())
    assert set(subs) == set(PINNED)
    for name, sub in subs.items():
        flags = {o for a in sub._actions for o in a.option_strings if o.startswith("--")} - {
            "--help"
        }
        assert flags == PINNED[name], name


def test_every_subcommand_has_json() -> None:
    assert all("--json" in flags for flags in PINNED.values())


def test_formats_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [f["name"] for f in data["formats"]] == list(FORMAT_NAMES)
    bf16 = next(f for f in data["formats"] if f["name"] == "bf16")
    assert bf16["mantissa_bits"] == 7 and bf16["min_update_at_one"] == 2.0**-8


def test_formats_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert "min subnormal" in out and "fp8_e5m2" in out and "65504" in out


def test_formats_lists_the_optimizer_storage_formats_with_their_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["formats", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    moments = {f["name"]: f["bytes_per_param"] for f in data["moments"]}
    masters = {f["name"]: f["bytes_per_param"] for f in data["masters"]}
    # two moments of a 768 x 768 matrix: int8 codes + an fp32 scale per 256; int4 codes
    # (half a byte) + an fp32 absmax per 128 + fp32 row and column maxima
    assert moments["fp32"] == 8 and moments["int8"] == 2 + 2 * 4 / 256
    assert moments["int4"] == 1 + 4 / 128 + 4 * 2 * 768 / 768**2
    assert masters["remainder8"] == 1 and masters["exact"] == 2
    assert main(["formats"]) == 0
    assert "int4" in capsys.readouterr().out


def test_policies_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in data["presets"]] == list(PRESET_NAMES)
    assert data["auto"]["resolves_to"] in PRESET_NAMES
    assert data["aliases"]["bf16-mixed"] == "amp_bf16"


def test_policies_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "bf16_lean" in out and "remainder8" in out and "auto" in out


@pytest.mark.parametrize("argv", [["bogus"], ["formats", "--jsn"], []])
def test_bad_input_exits_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mixprec")


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mixprec", "formats", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["formats"]


def test_an_abbreviated_flag_is_refused_not_guessed(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: `compare --seed 3` was read as `--seeds 3` and started a compare."""
    assert main(["compare", "--seed", "3"]) == 2
    assert "unrecognized arguments: --seed" in capsys.readouterr().err
