"""Faults around an experiment: odd contracts, hostile or stale files, odd losses.

Each case was reproduced on an earlier version (a reviewer's list and issue 12)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import pytest

import mixprec
from mixprec.cli import main
from mixprec.experiment import Contract, decide
from mixprec.experiment.records import RunRecord

from .test_decision import contract as make_contract
from .test_decision import paired, rec

TINY: dict[str, Any] = dict(size="tiny", seeds=2, max_seeds=2, steps=12, progress=False)


def _strict(path: Path) -> Any:
    def refuse(token: str) -> None:
        raise AssertionError(f"{path} holds {token}: not strict JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


# ------------------------------------------------------------- odd losses


def test_negative_losses_keep_the_sign_of_worse() -> None:
    """Held-out losses of -1.0 (baseline) and -0.5 (candidate): the candidate is worse."""
    records = paired("amp_bf16", [-1.0, -1.1, -0.9], [-0.5, -0.5, -0.5])
    d = decide(records, make_contract(candidates=("amp_bf16",)), higher_is_better=True)
    s = d.summary("amp_bf16")
    assert s.gap.mean == pytest.approx(0.5) and d.verdicts["amp_bf16"].status == "rejected"


def test_a_zero_baseline_loss_is_named() -> None:
    records = [rec("fp32", s, 0.0) for s in (0, 1)] + [rec("amp_bf16", s, 0.0) for s in (0, 1)]
    d = decide(records, make_contract(candidates=("amp_bf16",)), higher_is_better=True)
    assert "held-out loss is 0" in d.too_short and d.recommended is None
    assert d.verdicts["amp_bf16"].status == "too_short"


def test_a_baseline_that_never_trained_recommends_nothing(tmp_path: Path) -> None:
    """lr 0: every policy frozen at chance, yet fp16_unscaled was recommended."""
    results = mixprec.compare(
        "digits", "amp_bf16", out=tmp_path, lr=0.0 + 1e-12, min_lr=0.0, **TINY
    )
    d = results.decision
    assert "barely trained" in d.too_short and d.recommended is None
    assert d.summary("fp32").improvement < 0.05


def test_the_one_seed_reason_is_true() -> None:
    records = paired("amp_bf16", [1.0], [0.0])
    c = make_contract(candidates=("amp_bf16",), seeds=1, max_seeds=1)
    reason = decide(records, c, higher_is_better=True).verdicts["amp_bf16"].reason
    assert "no interval from one seed" in reason and "straddles" not in reason


# ------------------------------------------------------------- contracts


def test_aliases_are_resolved_before_duplicates_are_judged() -> None:
    with pytest.raises(ValueError, match="also listed as a candidate"):
        Contract(baseline="32", candidates=("float32",))
    with pytest.raises(ValueError, match="repeat a policy"):
        Contract(candidates=("bf16-mixed", "amp_bf16"))
    c = Contract(baseline="full", candidates=("bf16-mixed", "16-mixed"), step_caps={"amp": 3})
    assert c.baseline == "fp32" and c.candidates == ("amp_bf16", "amp_fp16")
    assert c.step_caps == {"amp_fp16": 3}


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"lr": "fast"}, "lr must be a number"),
        ({"lr": -1}, "got -1"),
        ({"lr": math.inf}, "lr must be a finite number"),
        ({"lr": 1e-3, "min_lr": 1e-2}, "must not exceed lr"),
        ({"weight_decay": "x"}, "weight_decay must be a number"),
        ({"grad_clip_norm": 0}, "grad_clip_norm must be a number > 0"),
        ({"workload": ["digits"]}, "workload must be a non-empty string"),
        ({"baseline": ["fp32"]}, "baseline must be a non-empty string"),
        ({"size": ["tiny"]}, "size must be a string"),
        ({1: "x"}, "unknown contract keys ['1']"),
        ({"gates": {"max_rel_loss_gap": "wide"}}, "max_rel_loss_gap must be a fraction"),
        ({"seeds": True}, "seeds must be an int"),
        ({"max_seeds": 10**6}, "max_seeds must be at most"),
        ({"allow": ["norm-in-16bit"]}, "not update-path rules"),
    ],
)
def test_contracts_with_wrong_types_are_refused(data: dict[Any, Any], fragment: str) -> None:
    with pytest.raises(ValueError) as exc:
        Contract.from_dict(data)
    assert fragment in str(exc.value)


def test_yaml_numbers_without_a_dot_are_numbers() -> None:
    """YAML 1.1 reads 1e-3 as a string."""
    c = Contract.from_dict({"lr": "1e-3", "gates": {"max_rel_loss_gap": "5e-3"}})
    assert c.train["lr"] == 1e-3 and c.gates.max_rel_loss_gap == 5e-3


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--device", "cuda:7" if not os.environ.get("CUDA_VISIBLE_DEVICES") else "tpu"], "device"),
        (["--device", "nonsense"], "unknown device"),
        (["--device", ""], "device is empty"),
        (["--lr", "-1"], "got -1"),
        (["--workload", "builtins:dict"], "Workload"),
        (["--workload", "math:pi"], "callable"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    flags: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["compare", "--size", "tiny", "--steps", "3", *flags, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("mixprec: error")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert err.splitlines()[-1] == errors[0] and fragment in errors[0]


def test_bad_out_folders_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out in (a_file, a_file / "below", Path("/dev/null")):
        argv = ["compare", "--workload", "digits", "--size", "tiny", "--out", str(out), "--quiet"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--out" in err and "Traceback" not in err


# ------------------------------------------------------------- records


def test_results_and_records_are_strict_json_with_shared_modes(tmp_path: Path) -> None:
    results = mixprec.compare("digits", "amp_bf16", out=tmp_path, **TINY)
    data = _strict(results.report.results_json)
    assert data["decision"]["policies"]["fp32"]["gap_mean"] is None  # NaN -> null
    for path in (tmp_path / "runs").glob("*.json"):
        _strict(path)
    modes = {
        stat.S_IMODE(p.stat().st_mode)
        for p in [results.report.results_json, results.report.html, *(tmp_path / "runs").glob("*")]
    }
    assert len(modes) == 1, modes
    again = RunRecord.from_dict(_strict(tmp_path / "runs" / "fp32-seed0.json"))
    assert again.heldout_loss == results.records[0].heldout_loss


def _compare(out: Path, *extra: str) -> int:
    argv = ["compare", "--workload", "digits", "--size", "tiny", "--seeds", "2"]
    return main([*argv, "--max-seeds", "2", "--out", str(out), "--quiet", *extra])


def test_a_corrupt_or_stray_record_is_skipped_and_only_its_run_redone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _compare(tmp_path, "--policies", "amp_bf16", "--steps", "10") in (0, 1)
    runs = tmp_path / "runs"
    (runs / "amp_bf16-seed1.json").write_text("{broken")
    edited = json.loads((runs / "amp_bf16-seed0.json").read_text())
    edited["policy"] = "fp32"
    (runs / "amp_bf16-seed0.json").write_text(json.dumps(edited))
    (runs / "stray.json").write_text('{"policy": 3}')
    capsys.readouterr()
    assert _compare(tmp_path, "--policies", "amp_bf16", "--steps", "10") in (0, 1)
    assert sorted(p.name for p in runs.glob("*.json"))[:4] == [
        "amp_bf16-seed0.json",
        "amp_bf16-seed1.json",
        "fp32-seed0.json",
        "fp32-seed1.json",
    ]
    assert json.loads((runs / "amp_bf16-seed0.json").read_text())["policy"] == "amp_bf16"
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--json"]) in (0, 1)
    err = capsys.readouterr().err
    assert "stray.json" in err and "Traceback" not in err


def test_report_uses_only_the_contracts_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _compare(tmp_path, "--policies", "amp_bf16,bf16_master", "--steps", "9") in (0, 1)
    first = json.loads((tmp_path / "results.json").read_text())
    assert _compare(tmp_path, "--policies", "amp_bf16", "--steps", "10") in (0, 1)
    printed = json.loads((tmp_path / "results.json").read_text())
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--json"]) in (0, 1)
    out = capsys.readouterr()
    rerendered = json.loads(out.out)
    assert rerendered["decision"]["policies"] == printed["decision"]["policies"]
    assert {r["steps"] for r in rerendered["runs"]} == {10}
    assert "ignored 2 record(s)" in out.err
    assert first["decision"]["policies"] != printed["decision"]["policies"]


def test_report_renders_an_interrupted_folder_and_names_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _compare(tmp_path, "--policies", "amp_bf16", "--steps", "10") in (0, 1)
    (tmp_path / "results.json").unlink()
    (tmp_path / "runs" / "amp_bf16-seed1.json").unlink()
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) in (0, 1)
    err = capsys.readouterr().err
    assert "missing runs" in err and "amp_bf16 seed 1" in err
    assert "missing runs" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("content", ["{}", "[]", "null", '{"contract": 3}'])
def test_report_refuses_a_results_file_without_a_contract(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "results.json").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "results.json holds no contract" in err and err.count("\n") == 1


def test_a_second_compare_on_the_same_folder_refuses(tmp_path: Path) -> None:
    fcntl = pytest.importorskip("fcntl")
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 12345\n")
        held.flush()
        with pytest.raises(ValueError, match="in use by another mixprec compare"):
            mixprec.compare("digits", "amp_bf16", out=tmp_path, **TINY)
    assert mixprec.compare("digits", "amp_bf16", out=tmp_path, **TINY).records


def test_whole_numbers_from_yaml_and_the_old_gate_key() -> None:
    c = Contract.from_dict({"steps": "1e2", "seeds": 3.0})
    assert c.train["steps"] == 100 and c.seeds == 3 and isinstance(c.train["steps"], int)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        Contract.from_dict({"steps": "1.5e1x"})
    with pytest.raises(ValueError, match=r"replaced by gates\.confidence"):
        Contract.from_dict({"noise_multiplier": 2})


@pytest.mark.parametrize(
    "flags",
    [["--size", "nope"], ["--workload", "nope"], ["--workload", "nomod_xyz:fn"], ["--out", ""]],
)
def test_refusals_come_before_any_output(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--workload", "digits", "--out", str(tmp_path / "o"), *flags]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Report files (report.md, report.html, the plots) are written like records."""
    from mixprec.experiment import records as records_module

    path = tmp_path / "report.md"
    records_module.write_text_atomic(path, "old\n")

    def crash(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(records_module.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        records_module.write_text_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
