from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.cli import main as mixprec_main
from mixprec.cli.doctor import add_parser, run

FIXTURES = Path(__file__).parents[1] / "doctor" / "fixtures"
CLEAN = str(FIXTURES / "mixprec" / "clean_bf16_master.yaml")
ERROR = str(FIXTURES / "nemo" / "optimizer-state-16bit.yaml")
WARNING = str(FIXTURES / "nemo" / "reduce-dtype-16bit.yaml")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mixprec")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return parser.parse_args(argv)


def test_doctor_flags_are_pinned() -> None:
    parser = argparse.ArgumentParser(prog="mixprec")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    doctor = sub.choices["doctor"]
    flags = {o for a in doctor._actions for o in a.option_strings if o.startswith("--")}
    assert flags - {"--help"} == {"--json", "--output", "--format", "--skip-unknown"}
    assert _parse(["doctor", CLEAN, "--json"]).output == "json"  # --json: --output json
    assert _parse(["doctor", CLEAN]).handler is run


@pytest.mark.parametrize(
    ("files", "code"), [([CLEAN], 0), ([WARNING], 0), ([ERROR], 1), ([CLEAN, ERROR], 1)]
)
def test_exit_codes(files: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_parse(["doctor", *files])) == code
    assert mixprec_main(["doctor", *files]) == code
    capsys.readouterr()


def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_parse(["doctor", CLEAN, ERROR, "--json"])) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["file"] for f in data["files"]] == [CLEAN, ERROR]
    assert [f["format"] for f in data["files"]] == ["mixprec", "nemo"]
    assert data["files"][0]["findings"] == []
    (finding,) = data["files"][1]["findings"]
    assert set(finding) == {"rule", "severity", "where", "message", "evidence", "fix"}
    assert finding["rule"] == "optimizer-state-16bit" and finding["severity"] == "error"
    assert finding["where"].startswith(f"{ERROR}:")


def test_human_output_groups_by_file_with_fixes(capsys: pytest.CaptureFixture[str]) -> None:
    run(_parse(["doctor", CLEAN, ERROR, WARNING]))
    out = capsys.readouterr().out
    assert f"{CLEAN} (mixprec): no findings" in out
    assert f"{ERROR} (nemo): 1 error" in out
    assert f"{WARNING} (nemo): 1 warning" in out
    assert out.index(ERROR) < out.index("optimizer-state-16bit") < out.index(WARNING)
    assert out.count("fix: ") == 2


def test_format_flag_overrides_detection(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_parse(["doctor", ERROR, "--format", "mixprec"])) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no mixprec keys found" in captured.err
    assert captured.err.count("\n") == 1 and "use --format nemo or omit --format" in captured.err
    assert run(_parse(["doctor", ERROR, "--format", "nemo", "--json"])) == 1
    capsys.readouterr()


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "no such file"), ("model: {torch_dtype: [bf16\n", "not valid YAML")],
)
def test_bad_input_is_exit_2_and_the_good_file_is_judged(
    content: str | None, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "recipe.yaml"
    if content is not None:
        path.write_text(content)
    assert mixprec_main(["doctor", CLEAN, str(path)]) == 2
    captured = capsys.readouterr()
    assert f"{CLEAN} (mixprec): no findings" in captured.out
    assert str(path) not in captured.out  # once: on stderr
    assert captured.err.count("\n") == 1 and f"mixprec doctor: {path}" in captured.err
    assert expected in captured.err


def test_an_unknown_format_flag_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert mixprec_main(["doctor", CLEAN, "--format", "yaml"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_module_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mixprec.doctor", ERROR, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1
    assert json.loads(out.stdout)["files"][0]["findings"][0]["rule"] == "optimizer-state-16bit"


def test_help_lists_every_config_format_the_doctor_reads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found in issue 30: `mixprec --help` named 2 of the doctor's formats (a hand list)."""
    from mixprec.doctor.frontends.dispatch import FRONT_ENDS

    with pytest.raises(SystemExit):
        mixprec_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    line = text[text.index("doctor lint") :]
    names = ", ".join(fe.name for fe in FRONT_ENDS)
    assert line[: line.index(")") + 1] == f"doctor lint training configs ({names})"
