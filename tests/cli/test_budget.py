"""`mixprec budget`: the command-line face of the estimate."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from tests.memory.hf_configs import GPT2

from mixprec.cli import main
from mixprec.memory import format_bytes
from mixprec.policy import PRESET_NAMES


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
    assert _table(out, "Per rank")["fp32"]["total"] == format_bytes(fp32["bytes"]["total"])


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


def _table(out: str, title: str) -> dict[str, dict[str, str]]:
    """The table under the line starting with `title`: policy -> column -> cell."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    header = re.split(r"\s{2,}", lines[start + 1].strip())
    rows = {}
    for line in lines[start + 3 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(header[1:], cells[1:], strict=False))
    return rows


@pytest.mark.parametrize(
    ("sharding", "rank_params", "all_params"),
    [("ddp", 14_000_000_000, 8 * 14_000_000_000), ("fsdp", 875_000_000 * 2, 14_000_000_000)],
)
def test_budget_rows_are_per_rank_with_the_all_rank_total_beside(
    capsys: pytest.CaptureFixture[str], sharding: str, rank_params: int, all_params: int
) -> None:
    # Reported: under ddp the rows were summed over ranks (params 104.31 GiB for 7B in
    # bf16), under fsdp they were one rank's, and neither said which.
    argv = ["budget", "--params", "7B", "--policy", "bf16_master", "--world-size", "8"]
    assert main([*argv, "--sharding", sharding]) == 0
    out = capsys.readouterr().out
    assert _table(out, "Per rank")["bf16_master"]["params"] == format_bytes(rank_params)
    assert _table(out, "All 8 ranks")["bf16_master"]["params"] == format_bytes(all_params)
    assert main([*argv, "--sharding", sharding, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["per_rank"]["params"] == rank_params
    assert d["all_ranks"]["params"] == all_params == d["bytes"]["params"]
    assert d["rank"] == 0
    comm = "all_reduce" if sharding == "ddp" else "reduce_scatter"
    assert d["comm_bytes_per_step"][comm] == 7_000_000_000 * 4  # fp32 reduce, one rank's buffer
    assert d["comm_bytes_per_step_all_ranks"][comm] == 8 * 7_000_000_000 * 4


def test_budget_zero_activations_say_how_to_get_a_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["budget", "--params", "7B", "--policy", "bf16_master"]) == 0
    out = capsys.readouterr().out
    assert _table(out, "Per rank")["bf16_master"]["activ"] == "n/a"
    assert "--activations" in out and "--config" in out
    argv = ["budget", "--params", "7B", "--policy", "bf16_master", "--activations", "1e9"]
    assert main(argv) == 0
    got = _table(capsys.readouterr().out, "Per rank")["bf16_master"]["activ"]
    assert got == "1.86 GiB"  # 1e9 bf16 values


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_budget_model_is_built_on_meta_and_bad_specs_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # torch.nn.Transformer() has 44M parameters: built on the meta device, no memory used.
    argv = ["budget", "--model", "torch.nn:Transformer", "--policy", "bf16_master", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        assert d["params"] == sum(p.numel() for p in torch.nn.Transformer().parameters())
    for spec in ("nocolon", "no_such_module_xyz:f", "json:no_such_function", "json:dumps"):
        assert main(["budget", "--model", spec]) == 2, spec
    assert main(["budget", "--model", "torch.nn:Linear", "--params", "7B"]) == 2


def test_budget_fp8_from_a_count_says_the_state_and_not_the_casts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["budget", "--params", "7B", "--policy", "bf16_master,fp8_tensorwise"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _table(out, "Per rank")
    assert (
        rows["bf16_master"]["fp8_casts"] == "0 B" and rows["fp8_tensorwise"]["fp8_casts"] == "n/a"
    )
    assert rows["bf16_master"]["total"] == rows["fp8_tensorwise"]["total"]
    assert "fp8 cast temporaries not estimated" in out and "--config" in out
    assert main([*argv, "--json"]) == 0
    bf16, fp8 = json.loads(capsys.readouterr().out)
    assert fp8["per_rank"] == bf16["per_rank"]
    assert bf16["fp8"] is None
    assert fp8["fp8"]["estimated"] is False and fp8["fp8"]["emulate"] is True
    assert main(["budget", "--params", "7B", "--policy", "bf16_master"]) == 0
    assert "fp8_casts" not in capsys.readouterr().out  # no fp8 policy: no column


def test_budget_fp8_from_a_config_sizes_the_casts_for_the_device(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    import pathlib

    config = pathlib.Path(str(tmp_path)) / "gpt2.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 12,
                "n_embd": 768,
                "n_head": 12,
                "vocab_size": 50257,
                "block_size": 1024,
            }
        )
    )
    got = {}
    for device in ("cpu", "cuda"):
        argv = ["budget", "--config", str(config), "--policy", "fp8_rowwise", "--json"]
        assert main([*argv, "--device", device]) == 0
        got[device] = json.loads(capsys.readouterr().out)
    cpu, cuda = got["cpu"], got["cuda"]
    assert cpu["fp8"]["emulate"] is True and cpu["fp8"]["estimated"] is True
    if not torch.cuda.is_available():  # assumed: a GPU with FP8 units
        assert cuda["fp8"]["emulate"] is False
    assert 0 < cuda["per_rank"]["fp8_cast_temporaries"] < cpu["per_rank"]["fp8_cast_temporaries"]
    assert cpu["fp8"]["layer"] == "3072x768"  # the MLP's down projection, backward
    assert main(["budget", "--config", str(config), "--device", "tpu"]) == 2


def test_budget_fp8_from_a_module_says_how_many_layers_convert_and_a_cli_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A module without inputs: the text gives the converted-layer count (as --json does)
    and a fix a CLI user can apply, not only a Python argument."""
    argv = ["budget", "--model", "tests.cli.budget_models:four_linears", "--policy"]
    assert main([*argv, "fp8_tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "fp8 cast temporaries not estimated (2 linear layer(s) convert)" in out
    assert "mixprec budget --config CONFIG.json --seq-len N --micro-batch B" in out
    assert main([*argv, "fp8_tensorwise", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fp8"]["converted"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "source",
    [["--params", "7B"], ["--model", "tests.cli.budget_models:four_linears"]],
    ids=["params", "model"],
)
def test_budget_world_size_costs_no_time_per_rank(
    capsys: pytest.CaptureFixture[str], source: list[str]
) -> None:
    """Reported: --world-size took time linear in its value (10^7: over 100 s, 10^20:
    never returned). Rank 0 of 10^20 holds one row of each tensor (torch.chunk rounds
    up), padded on every rank."""
    ranks = 10**20
    argv = ["budget", *source, "--policy", "bf16_lean", "--world-size", str(ranks), "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["world_size"] == ranks
    if source[0] == "--params":
        assert d["per_rank"]["params"] == 2  # one bf16 element of the one long tensor
        assert d["all_ranks"]["params"] == 2 * ranks
        # masters come from each rank's unpadded shard: the model once (remainder8: 1 B)
        assert d["all_ranks"]["master"] == 7_000_000_000
    else:
        assert d["per_rank"]["params"] == 2 * (64 + 1 + 3 * (128 + 1))  # a row of each tensor
    assert main([*argv[:-1]]) == 0  # the table too


def test_budget_small_models_get_units_that_show_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Reported: a small model printed 0.00 everywhere (fixed GiB). Each value takes its
    own unit; --json stays in exact bytes."""
    assert main(["budget", "--params", "1000", "--policy", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "0.00" not in out
    fp32 = _table(out, "Per rank")["fp32"]
    assert fp32["params"] == "3.91 KiB"  # 4000 bytes
    assert fp32["moments"] == "7.81 KiB"  # 8000 bytes
    assert fp32["master"] == "0 B"
    assert main(["budget", "--params", "1000", "--policy", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_rank"]["params"] == 4000
    assert main(["budget", "--params", "7B", "--policy", "fp32"]) == 0
    assert _table(capsys.readouterr().out, "Per rank")["fp32"]["params"] == "26.1 GiB"


@pytest.mark.parametrize(
    "source",
    [
        ["--params", "7B"],
        ["--config", "GPT2"],
        ["--model", "tests.cli.budget_models:with_buffers"],
        [
            "--model",
            "tests.cli.budget_models:with_buffers",
            "--grad-accum-dtype",
            "fp32",
            "--sharding",
            "ddp",
        ],
    ],
    ids=["params", "config", "model", "model-accum"],
)
def test_budget_every_policy_on_8_ranks_fits_120_columns(
    capsys: pytest.CaptureFixture[str], tmp_path: object, source: list[str]
) -> None:
    """Reported: the 8-rank table of every policy was about 330 columns wide."""
    import pathlib

    if source[1] == "GPT2":
        config = pathlib.Path(str(tmp_path)) / "gpt2.json"
        config.write_text(json.dumps(GPT2))
        source = ["--config", str(config)]
    assert main(["budget", *source, "--policy", "all", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    for line in out.splitlines():
        if not line.startswith("note: "):  # prose: the terminal wraps it
            assert len(line) <= 120, line
    per_rank, all_ranks = _table(out, "Per rank"), _table(out, "All 8 ranks")
    # gradient release runs in one process: its preset is left out, with a note
    assert list(per_rank) == list(all_ranks) == [p for p in PRESET_NAMES if p != "bf16_lean4"]
    assert "note: bf16_lean4 left out: gradient release runs in one process" in out
    comm = _table(out, "Communication")
    assert comm["fp32"]["all_reduce" if "ddp" in source else "all_gather"]
    assert comm["fp32"]["(all 8)"]
    assert ("buffers" in per_rank["fp32"]) == (source[0] == "--model")  # BatchNorm statistics
    assert ("accum" in per_rank["bf16_master"]) == ("--grad-accum-dtype" in source)


def test_budget_grad_accum_dtype_shows_the_fp32_sums(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["budget", "--params", "1B", "--policy", "bf16_master,amp_bf16"]
    assert main(argv) == 0
    assert "grad_accum" not in capsys.readouterr().out  # not asked: not shown
    assert main([*argv, "--grad-accum-dtype", "fp32"]) == 0
    assert "grad_accum" in capsys.readouterr().out
    assert main([*argv, "--grad-accum-dtype", "fp32", "--json"]) == 0
    master, amp = json.loads(capsys.readouterr().out)
    assert master["per_rank"]["grad_accum"] == 4_000_000_000
    assert amp["per_rank"]["grad_accum"] == 0  # fp32 parameters sum in fp32 already
    assert main([*argv, "--grad-accum-dtype", "fp32", "--world-size", "2"]) == 2  # FSDP2
    assert "policy 'bf16_master'" in capsys.readouterr().err  # refused as prepare refuses it
    argv = ["budget", "--params", "1B", "--policy", "fp32,amp_bf16", "--world-size", "2"]
    assert main([*argv, "--grad-accum-dtype", "fp32"]) == 0  # no 16-bit gradient to sum


def test_budget_from_a_config_says_the_sequence_it_sized(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Review: a Llama-3.2-1B config gave 299 GiB of activations for its 131,072-token
    context without saying which sequence length it had assumed."""
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps(GPT2))
    assert main(["budget", "--config", str(config), "--policy", "bf16_master"]) == 0
    out = capsys.readouterr().out
    assert "for sequences of 1,024 tokens (the config's longest sequence), micro-batch 1" in out
    argv = ["budget", "--config", str(config), "--policy", "bf16_master", "--seq-len", "64"]
    assert main(argv) == 0
    assert "sequences of 64 tokens (--seq-len)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("optimizer", "args", "policy", "rule", "per_param"),
    [
        # bf16 params 2 + bf16 grads 2 + exact master 2 + fp32 momentum 4 (issue 34's example)
        ("sgd", "momentum=0.9", "bf16_master", "sgd_momentum", (2, 2, 2, 4)),
        ("sgd", None, "bf16_master", "sgd", (2, 2, 2, 0)),
        ("adam", "amsgrad=true", "bf16_master", "adam_amsgrad", (2, 2, 2, 12)),
        ("lion", "betas=(0.9,0.99)", "fp32", "lion", (4, 4, 0, 4)),
        ("adamw", None, "fp32", "adamw", (4, 4, 0, 8)),
    ],
)
def test_budget_counts_the_moments_of_the_optimizers_rule(
    capsys: pytest.CaptureFixture[str],
    optimizer: str,
    args: str | None,
    policy: str,
    rule: str,
    per_param: tuple[int, int, int, int],
) -> None:
    n = 1 << 20
    argv = ["budget", "--params", str(n), "--policy", policy, "--optimizer", optimizer]
    argv += ["--optimizer-args", args] if args else []
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    got = tuple(d["per_rank"][c] for c in ("params", "grads", "master", "moments"))
    assert d["rule"] == rule and got == tuple(b * n for b in per_param)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"optimizer: {optimizer}(") and f"rule {rule}" in out
    row = _table(out, "Bytes per parameter")[policy]
    assert [row[c] for c in ("params", "grads", "master", "moments")] == [
        f"{b:.2f}" if b else "0" for b in per_param
    ]
    assert row["total"] == f"{sum(per_param):.2f}"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--optimizer", "muon"], "unknown optimizer 'muon'; valid: adamw, adam, sgd, lion"),
        (["--optimizer", "sgd", "--optimizer-args", "foo=1"], "takes no argument 'foo'; valid:"),
        (["--optimizer-args", "momentum"], "'momentum' is not key=value"),
        (["--optimizer", "sgd", "--optimizer-args", "nesterov=true"], "Nesterov momentum"),
        (["--optimizer", "sgd", "--optimizer-args", "moments=int8"], "the policy decides"),
    ],
)
def test_budget_bad_optimizer_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert main(["budget", "--params", "1e6", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
