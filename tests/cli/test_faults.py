"""Bad input on the command line: exit 2 with one line, no traceback; Ctrl-C exits 130."""

from __future__ import annotations

import importlib
import io
import sys
import time
from pathlib import Path

import pytest

from mixprec.cli import main

BOMB_LEVELS = 9


def _bomb(path: Path) -> Path:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, BOMB_LEVELS):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path


def _deep(path: Path) -> Path:
    path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    return path


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < 20
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("count", ["inf", "1e400", "nan", "-3", "0", "1e16", "seven"])
def test_budget_refuses_counts(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_exit_2(["budget", "--params", count], capsys)
    assert repr(count) in err


def test_budget_refuses_options_that_do_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--config" in _one_line_exit_2(["budget", "--params", "7B", "--seq-len", "8"], capsys)
    err = _one_line_exit_2(["budget", "--params", "7B", "--sharding", "ddp"], capsys)
    assert "--world-size" in err


@pytest.mark.parametrize("make", [_bomb, _deep])
def test_hostile_yaml_is_refused_quickly_everywhere(
    make: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = make(tmp_path / "evil.yaml")  # type: ignore[operator]
    for argv in (
        ["doctor", str(path)],
        ["budget", "--config", str(path)],
        ["compare", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"],
    ):
        err = _one_line_exit_2(argv, capsys)
        assert "evil.yaml" in err


def test_traceback_flag_and_debug_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "raising_workload.py").write_text(
        "def make_workload():\n    raise RuntimeError('my dataset is missing')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["compare", "--workload", "raising_workload:make_workload", "--out", str(tmp_path)]
    err = _one_line_exit_2([*argv, "--quiet"], capsys)
    assert "RuntimeError: my dataset is missing" in err and "--traceback" in err
    assert main(["--traceback", *argv, "--quiet"]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("MIXPREC_DEBUG", "1")
    assert main([*argv, "--quiet"]) == 2
    assert "Traceback" in capsys.readouterr().err


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError


def test_broken_pipe_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["policies", "--json"]) == 0


def test_ctrl_c_during_compare_exits_130_and_keeps_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = importlib.import_module("mixprec.experiment.runner")
    real = runner.run_one
    calls = []

    def interrupted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_one", interrupted)
    argv = ["compare", "--workload", "digits", "--size", "tiny", "--steps", "5"]
    assert main([*argv, "--policies", "amp_bf16", "--out", str(tmp_path), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err and err.count("\n") == 1
    assert [p.name for p in (tmp_path / "runs").glob("*.json")] == ["fp32-seed0.json"]


@pytest.mark.parametrize("value", ['"64"', "64.5", "true", ".nan", "1e3", "-4"])
def test_budget_config_values_must_be_whole_numbers(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "model.yaml"
    config.write_text(
        f"num_hidden_layers: 2\nhidden_size: {value}\nnum_attention_heads: 4\n"
        "vocab_size: 100\nmax_position_embeddings: 64\n"
    )
    err = _one_line_exit_2(["budget", "--config", str(config)], capsys)
    assert "model.yaml" in err and "'hidden_size'" in err


def test_the_cli_starts_without_importing_torch() -> None:
    import subprocess

    code = "import sys, mixprec.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.3, 1.0])
def test_ctrl_c_while_starting_is_one_line(delay_s: float, tmp_path: Path) -> None:
    """Ctrl-C during the first seconds (torch still importing) printed a traceback."""
    import signal
    import subprocess

    argv = [sys.executable, "-m", "mixprec.cli", "compare", "--workload", "digits"]
    argv += ["--size", "tiny", "--steps", "40", "--out", str(tmp_path), "--quiet"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (130, 0, 1), (proc.returncode, err)  # 0/1: it finished first
    assert "Traceback" not in err
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1].startswith("mixprec: interrupted")


def test_a_user_workload_s_error_keeps_its_type_and_leaves_no_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: the line lost the exception type, and a refused workload still
    created the --out folder."""
    out = tmp_path / "never"
    assert main(["compare", "--workload", "os:system", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "workload 'os:system' raised TypeError" in err[0]
    assert not out.exists()
    assert main(["compare", "--workload", "nope", "--out", str(out)]) == 2
    assert not out.exists()
