"""`mixprec budget`: the command-line face of the estimate."""

from __future__ import annotations

import json
import math

import pytest

from mixprec.cli import main
from mixprec.policy import PRESET_NAMES

GiB = 2.0**30


def test_budget_cli_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["budget", "--params", "7e9", "--policy", "all"]) == 0
    out = capsys.readouterr().out
    for name in PRESET_NAMES:
        assert name in out
    assert main(["budget", "--params", "7e9", "--policy", "all", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["policy"] for d in data] == list(PRESET_NAMES)
    fp32 = data[0]
    assert (
        fp32["bytes"]["params"] + fp32["bytes"]["grads"] + fp32["bytes"]["moments"]
        == 112_000_000_000
    )
    assert set(fp32) >= {
        "policy",
        "params",
        "world_size",
        "bytes",
        "per_rank",
        "comm_bytes_per_step",
    }
    assert f"{fp32['bytes']['total'] / GiB:.2f}" in out


def test_budget_cli_huge_inputs_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "budget",
                "--params",
                "70B",
                "--policy",
                "bf16_master",
                "--world-size",
                "1024",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["world_size"] == 1024 and d["per_rank"]["moments"] == math.ceil(70e9 / 1024) * 8
    assert main(["budget", "--params", "lots"]) == 2
    assert main(["budget"]) == 2
    assert main(["budget", "--config", "/nonexistent.json"]) == 2
