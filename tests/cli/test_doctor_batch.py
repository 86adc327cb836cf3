"""`mixprec doctor` over many files: one odd file never stops a batch (issue 17)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mixprec.cli import main as mixprec_main

FIXTURES = Path(__file__).parents[1] / "doctor" / "fixtures"
CLEAN = str(FIXTURES / "mixprec" / "clean_bf16_master.yaml")
ERROR = str(FIXTURES / "nemo" / "optimizer-state-16bit.yaml")


def _recipe(tmp_path: Path, max_steps: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(
        "model:\n  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained\n"
        "  torch_dtype: float32\n"
        f"step_scheduler:\n  max_steps: {max_steps}\n"
        "optimizer:\n  _target_: torch.optim.AdamW\n"
    )
    return str(path)


def _json(capsys: pytest.CaptureFixture[str]) -> dict[str, list[dict[str, object]]]:
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_a_value_of_an_unexpected_type_is_a_finding_and_the_batch_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = _recipe(tmp_path, "[1, 2]")
    assert mixprec_main(["doctor", CLEAN, odd, ERROR, "--json"]) == 1
    files = _json(capsys)["files"]
    assert [f["file"] for f in files] == [CLEAN, odd, ERROR]
    (finding,) = files[1]["findings"]  # type: ignore[misc]
    assert finding["rule"] == "config-unreadable" and finding["severity"] == "error"
    assert finding["where"] == f"{odd}:5 step_scheduler.max_steps"
    assert "must be an integer" in finding["message"]
    assert files[2]["findings"][0]["rule"] == "optimizer-state-16bit"  # type: ignore[index]


def test_a_file_that_cannot_be_read_is_exit_2_and_the_others_are_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {torch_dtype: [bf16\n")
    missing = str(tmp_path / "missing.yaml")
    assert mixprec_main(["doctor", CLEAN, str(broken), missing, ERROR, "--json"]) == 2
    files = _json(capsys)["files"]
    assert len(files) == 4
    assert files[0]["findings"] == []
    for entry, reason in ((files[1], "not valid YAML"), (files[2], "no such file")):
        (finding,) = entry["findings"]  # type: ignore[misc]
        assert finding["rule"] == "config-unreadable" and reason in finding["message"]
    assert files[1]["findings"][0]["where"].startswith(f"{broken}:")  # type: ignore[index]
    assert files[3]["findings"][0]["rule"] == "optimizer-state-16bit"  # type: ignore[index]


def test_human_output_names_the_unreadable_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = _recipe(tmp_path, "abc")
    assert mixprec_main(["doctor", odd, CLEAN]) == 1
    out = capsys.readouterr().out
    assert f"{odd} (nemo): 1 error" in out and "config-unreadable" in out
    assert f"{CLEAN} (mixprec): no findings" in out


def test_unknown_keys_never_fail_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(Path(ERROR).read_text() + "\nsomething_new:\n  x: [1, {y: 2}]\n")
    assert mixprec_main(["doctor", str(path), "--json"]) == 1
    (finding,) = _json(capsys)["files"][0]["findings"]  # type: ignore[misc]
    assert finding["rule"] == "optimizer-state-16bit"


def test_a_directory_is_walked_and_unknown_files_are_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "recipe.yaml").write_text(Path(ERROR).read_text())
    (tmp_path / "clean.yaml").write_text(Path(CLEAN).read_text())
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "other.yaml").write_text("seed: 3\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.yaml").write_text(Path(ERROR).read_text())
    assert mixprec_main(["doctor", str(tmp_path), "--json"]) == 1
    data = _json(capsys)
    assert [Path(str(f["file"])).name for f in data["files"]] == ["clean.yaml", "recipe.yaml"]
    assert data["skipped"] == 2
    assert mixprec_main(["doctor", str(tmp_path)]) == 1
    assert "skipped 2 files of no known format" in capsys.readouterr().out


def test_globs_are_expanded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.yaml").write_text(Path(ERROR).read_text())
    (tmp_path / "b.yaml").write_text(Path(CLEAN).read_text())
    assert mixprec_main(["doctor", str(tmp_path / "*.yaml"), "--json"]) == 1
    assert [Path(str(f["file"])).name for f in _json(capsys)["files"]] == ["a.yaml", "b.yaml"]


def test_a_recursive_glob_does_not_follow_links_to_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: `**` followed a link to the parent folder, so one file was judged
    40 times, and with two such links the doctor never finished."""
    sub = tmp_path / "g" / "sub"
    sub.mkdir(parents=True)
    (sub / "a.yaml").write_text(Path(ERROR).read_text())
    (sub / "up").symlink_to("..")
    (sub / "loop").symlink_to("../sub")
    assert mixprec_main(["doctor", str(tmp_path / "g" / "**" / "*.yaml"), "--json"]) == 1
    assert [Path(str(f["file"])).name for f in _json(capsys)["files"]] == ["a.yaml"]


def test_a_named_file_of_no_known_format_is_unreadable_unless_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "ci.yaml"
    other.write_text("on: push\njobs: {}\n")
    assert mixprec_main(["doctor", str(other), CLEAN, "--json"]) == 2
    (finding,) = _json(capsys)["files"][0]["findings"]  # type: ignore[misc]
    assert "cannot tell the config format" in finding["message"]
    assert mixprec_main(["doctor", str(other), CLEAN, "--skip-unknown", "--json"]) == 0
    data = _json(capsys)
    assert len(data["files"]) == 1 and data["skipped"] == 1


def test_values_left_to_the_environment_are_listed_as_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _recipe(tmp_path, "${oc.env:STEPS}")
    assert mixprec_main(["doctor", path, "--json"]) == 0  # fp32 storage: nothing to judge
    (entry,) = _json(capsys)["files"]
    assert entry["unknown"] == [
        f"{path}:5 step_scheduler.max_steps: ${{oc.env:STEPS}} (set by the run's environment)"
    ]
    assert mixprec_main(["doctor", path]) == 0
    assert "unknown  [" in capsys.readouterr().out


def test_a_forced_format_skips_walked_files_of_other_formats_and_refuses_named_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--format over a directory judges the files of that format and counts the rest; a
    file named explicitly in another format is exit 2 with one line saying which format."""
    (tmp_path / "recipe.yaml").write_text(Path(ERROR).read_text())  # NeMo
    (tmp_path / "clean.yaml").write_text(Path(CLEAN).read_text())  # mixprec
    assert mixprec_main(["doctor", str(tmp_path), "--format", "nemo", "--json"]) == 1
    data = _json(capsys)
    assert [Path(str(f["file"])).name for f in data["files"]] == ["recipe.yaml"]
    assert data["skipped"] == 1
    assert mixprec_main(["doctor", CLEAN, "--format", "nemo"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # the text report leaves out what is on stderr
    (line,) = captured.err.splitlines()
    assert "no nemo keys found" in line
    assert "is this a mixprec file? use --format mixprec or omit --format" in line


@pytest.mark.parametrize(
    ("content", "reason"),
    [("", "empty"), ("- id: mixprec-doctor\n  entry: mixprec doctor\n", "got list")],
)
def test_a_named_file_that_is_not_a_mapping_is_unreadable_unless_skipped(
    tmp_path: Path, content: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Well-formed YAML of no config format (an empty file, a top-level list such as
    .pre-commit-hooks.yaml): config-unreadable when named; --skip-unknown skips it, as
    the pre-commit hook promises for 'other YAML'."""
    path = tmp_path / "hooks.yaml"
    path.write_text(content)
    assert mixprec_main(["doctor", str(path), CLEAN, "--json"]) == 2
    (finding,) = _json(capsys)["files"][0]["findings"]  # type: ignore[misc]
    assert finding["rule"] == "config-unreadable" and reason in finding["message"]
    assert mixprec_main(["doctor", str(path), CLEAN, "--skip-unknown", "--json"]) == 0
    assert _json(capsys)["skipped"] == 1


def test_skip_unknown_never_skips_a_file_that_cannot_be_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {torch_dtype: [bf16\n")
    two = tmp_path / "two.yaml"
    two.write_text("a: 1\n---\nb: 2\n")
    assert mixprec_main(["doctor", str(broken), str(two), "--skip-unknown", "--json"]) == 2
    data = _json(capsys)
    assert data["skipped"] == 0
    assert [f["findings"][0]["rule"] for f in data["files"]] == ["config-unreadable"] * 2  # type: ignore[index]


@pytest.mark.parametrize("skip", [[], ["--skip-unknown"]])
def test_a_glob_that_matches_nothing_is_one_line_naming_it(
    tmp_path: Path, skip: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    pattern = str(tmp_path / "configs" / "**" / "*.yaml")
    assert mixprec_main(["doctor", pattern, CLEAN, *skip]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert f"no file matches the glob {pattern!r}" in line and "quote the glob" in line
    assert f"{CLEAN} (mixprec): no findings" in captured.out


def test_control_characters_in_file_names_never_break_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: a newline in a file name split the one stderr line (and the
    text report's lines); every output format escapes it."""
    odd = tmp_path / "bad\nname\x1b.yaml"
    odd.write_text("a: [1\n")  # not valid YAML: exit 2, one stderr line
    judged = tmp_path / "second\u2028line.yaml"
    judged.write_text(Path(ERROR).read_text())
    args = ["doctor", str(odd), str(judged)]
    assert mixprec_main(args) == 2
    captured = capsys.readouterr()
    assert "second\\u2028line.yaml (nemo): 1 error" in captured.out
    assert not any(c in captured.out + captured.err for c in "\x1b\u2028")
    (line,) = captured.err.splitlines()
    assert line.startswith("mixprec doctor: ") and "bad\\nname\\x1b.yaml" in line
    assert line.endswith(": not valid YAML: did not find expected ',' or ']'")
    assert mixprec_main([*args, "--json"]) == 2
    files = _json(capsys)["files"]
    assert [f["file"] for f in files] == [str(odd), str(judged)]
    assert mixprec_main([*args, "--output", "github"]) == 2
    assert len(capsys.readouterr().out.split("\n")) == 2 + 1  # two commands, final newline
    assert mixprec_main([*args, "--output", "sarif"]) == 2
    uris = [
        r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
        for r in json.loads(capsys.readouterr().out)["runs"][0]["results"]
    ]
    assert "bad%0Aname%1B.yaml" in uris[0] and "second%E2%80%A8line.yaml" in uris[1]


def test_a_walk_skips_broken_links_with_skip_unknown_and_reports_them_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: a broken link met while walking was exit 2 even with
    --skip-unknown (the pre-commit hook's flag)."""
    (tmp_path / "clean.yaml").write_text(Path(CLEAN).read_text())
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "deleted.yaml")
    (tmp_path / "notes.txt").symlink_to(tmp_path / "deleted.txt")  # not a config suffix
    assert mixprec_main(["doctor", str(tmp_path), "--skip-unknown", "--json"]) == 0
    data = _json(capsys)
    assert [Path(str(f["file"])).name for f in data["files"]] == ["clean.yaml"]
    assert data["skipped_broken_links"] == 1 and data["skipped"] == 1
    assert mixprec_main(["doctor", str(tmp_path), "--skip-unknown"]) == 0
    assert "skipped 1 broken symbolic link" in capsys.readouterr().out
    assert mixprec_main(["doctor", str(tmp_path), "--json"]) == 2
    files = _json(capsys)["files"]
    (finding,) = files[1]["findings"]  # type: ignore[misc]
    assert finding["rule"] == "config-unreadable"
    assert "a broken symbolic link (to " in finding["message"]


def _one_line(capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Stdout and the one line on stderr."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    return captured.out, captured.err.strip()


def test_a_file_that_cannot_be_read_is_one_line_on_stderr_and_not_repeated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in issue 30: `mixprec doctor missing.yaml` printed its error twice (the
    report on stdout, then the line on stderr)."""
    missing = tmp_path / "missing.yaml"
    assert mixprec_main(["doctor", str(missing)]) == 2
    out, err = _one_line(capsys)
    assert out == ""
    assert err == f"mixprec doctor: {missing}: no such file; check the path"
    assert mixprec_main(["doctor", str(missing), CLEAN]) == 2
    out, err = _one_line(capsys)
    assert f"{CLEAN} (mixprec): no findings" in out and str(missing) not in out
    assert mixprec_main(["doctor", str(missing), "--json"]) == 2  # stdout hides it: also stderr
    out, err = _one_line(capsys)
    assert json.loads(out)["files"][0]["file"] == str(missing)
    assert err == f"mixprec doctor: {missing}: no such file; check the path"


def test_a_folder_or_glob_with_no_config_file_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in issue 30: `mixprec doctor EMPTY_DIR` exited 0 with no output, so a CI
    step pointed at the wrong folder passed."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert mixprec_main(["doctor", str(empty)]) == 2
    out, err = _one_line(capsys)
    assert out == ""
    assert err.startswith(f"mixprec doctor: {empty}: no config file found (it holds no file)")
    assert "check the path" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello\n")
    (other / "ci.yaml").write_text("on: push\n")
    assert mixprec_main(["doctor", str(other), CLEAN, "--skip-unknown"]) == 2
    out, err = _one_line(capsys)
    assert f"{CLEAN} (mixprec): no findings" in out
    assert f"{other}: no config file found (2 files skipped: of no known format)" in err
    pattern = str(other / "*.yaml")
    assert mixprec_main(["doctor", pattern, "--json"]) == 2
    out, err = _one_line(capsys)
    (entry,) = json.loads(out)["files"]
    assert entry["file"] == pattern and entry["findings"][0]["rule"] == "config-unreadable"
    assert f"{pattern}: no config file found (1 file skipped" in err


def test_a_symlink_loop_is_named_a_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found in issue 30: a loop was 'a broken symbolic link (to 'b.yaml', which does not
    exist)', although b.yaml exists (a link back to a.yaml)."""
    (tmp_path / "a.yaml").symlink_to("b.yaml")
    (tmp_path / "b.yaml").symlink_to("a.yaml")
    assert mixprec_main(["doctor", str(tmp_path / "a.yaml")]) == 2
    _, err = _one_line(capsys)
    assert err == (
        f"mixprec doctor: {tmp_path / 'a.yaml'}: a symbolic link loop (following 'b.yaml' "
        "never reaches a file); point the link at a file"
    )
    assert mixprec_main(["doctor", str(tmp_path), "--skip-unknown"]) == 2  # links: skipped
    _, err = _one_line(capsys)
    assert "no config file found (2 broken symbolic links skipped)" in err
    (tmp_path / "c.yaml").symlink_to("d.yaml")  # a chain whose end is missing
    (tmp_path / "d.yaml").symlink_to("gone.yaml")
    assert mixprec_main(["doctor", str(tmp_path / "c.yaml")]) == 2
    _, err = _one_line(capsys)
    gone = os.path.realpath(tmp_path / "gone.yaml")
    assert err.endswith(f"(to 'd.yaml', a link to {gone!r}, which does not exist)")
