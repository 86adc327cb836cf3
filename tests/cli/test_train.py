"""`mixprec train`: bitwise resume in new processes, SIGTERM and Ctrl-C, bad input,
`--policy-from`, and a YAML recipe that equals the flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.experiment.test_training import final_state

import mixprec
from mixprec.cli import main
from mixprec.experiment import Contract

SRC = str(Path(mixprec.__file__).resolve().parents[1])
HERE = Path(__file__).resolve().parent

#: The tiny digits workload: a process spends its time importing torch, not training.
TINY = ["--workload", "digits", "--size", "tiny"]


def _env(**extra: str) -> dict[str, str]:
    """This environment with this checkout's source first on the path (and this folder,
    for `signal_workload`), and `extra` added."""
    path = os.pathsep.join([SRC, str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _cli(*args: str, **env: str) -> subprocess.Popen[str]:
    """`python -m mixprec ARGS` in a new process (see `_env`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "mixprec", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(**env),
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _metrics(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without the wall-clock field."""
    lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


def _final_state(out: Path, policy: str) -> dict[str, torch.Tensor]:
    """Model, optimizer and loss-scaler tensors of the newest checkpoint under `out`."""
    return final_state(out / "checkpoints", policy)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key].detach().reshape(-1), b[key].detach().reshape(-1)
        assert x.dtype == y.dtype, key
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), key


def _exported(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((out / "export").glob("*.safetensors"))
    assert files, f"no export under {out}"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


@pytest.mark.slow
def test_a_run_stopped_and_resumed_in_new_processes_is_bitwise_the_uninterrupted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = 12  # 2N with N = 6; the stop falls between two checkpoints (save_every 4)
    policies = ("bf16_master", "amp_fp16")
    common = [*TINY, "--steps", str(steps), "--save-every", "4", "--eval-every", "4"]
    stopped = {  # new processes, side by side
        p: _cli("train", *common, "--policy", p, "--out", str(tmp_path / p), "--stop-after", "6")
        for p in policies
    }
    for p in policies:  # meanwhile, the uninterrupted runs in this process
        assert main(["train", *common, "--policy", p, "--out", str(tmp_path / "whole" / p)]) == 0
    capsys.readouterr()
    resumed = {}
    for policy, proc in stopped.items():
        b = tmp_path / policy
        code, _, err = _finish(proc)
        assert code == 0, err
        assert (
            f"stopped (--stop-after 6) after step 6 of {steps}; checkpoint "
            f"{b / 'checkpoints' / 'step_00000006'}; resume with: mixprec train --out {b} --resume"
        ) in err
        assert [line["step"] for line in _metrics(b)] == list(range(1, 7))
        resumed[policy] = _cli("train", "--out", str(b), "--resume", "--json")  # its recipe.json
    for policy, proc in resumed.items():
        a, b = tmp_path / "whole" / policy, tmp_path / policy
        code, out, err = _finish(proc)
        assert code == 0, err
        summary = json.loads(out)
        assert summary["status"] == "finished" and summary["step"] == steps
        assert summary["policy"] == policy and summary["checkpoint"]["step"] == steps
        assert _metrics(a) == _metrics(b), policy  # every step's loss, lr, scale, norm, eval
        assert len(_metrics(b)) == steps
        _assert_bitwise(_final_state(a, policy), _final_state(b, policy))
        _assert_bitwise(_exported(a), _exported(b))


@pytest.mark.slow
def test_sigterm_and_ctrl_c_stop_after_the_step_in_progress_and_resume_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The signals come from outside while step 4 (index 3) is in progress: its batch
    # waits for them (`signal_workload`), so the stop point is the same on any machine.
    monkeypatch.syspath_prepend(str(HERE))
    spec = "signal_workload:make_workload"
    run = ["train", "--workload", spec, "--policy", "bf16_master", "--steps", "10"]
    signals = {"SIGTERM": (signal.SIGTERM, 143), "Ctrl-C": (signal.SIGINT, 130)}
    marker = {name: tmp_path / f"{name}.waiting" for name in signals}
    procs = {
        name: _cli(*run, "--out", str(tmp_path / name), MIXPREC_TEST_MARKER=str(marker[name]))
        for name in signals
    }
    assert main([*run, "--out", str(tmp_path / "whole")]) == 0  # meanwhile, never stopped
    for name, proc in procs.items():
        deadline = time.monotonic() + 60
        while not marker[name].exists():  # step 4 is waiting for the signal
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signals[name][0])
    capsys.readouterr()
    for name, proc in procs.items():
        out = tmp_path / name
        returncode, _, err = _finish(proc)
        assert returncode == signals[name][1], err
        assert "Traceback" not in err
        assert [line["step"] for line in _metrics(out)] == [1, 2, 3, 4]  # step 4 finished
        assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000004"
        assert err.splitlines()[-1] == (
            f"mixprec train: stopped ({name}) after step 4 of 10; checkpoint "
            f"{out / 'checkpoints' / 'step_00000004'}; resume with: "
            f"mixprec train --workload {spec} --out {out} --resume"
        )
        assert json.loads((out / "train.json").read_text())["status"] == "stopped"

        assert main(["train", "--workload", spec, "--out", str(out), "--resume", "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["status"] == "finished" and summary["step"] == 10
        assert _metrics(out) == _metrics(tmp_path / "whole")
        _assert_bitwise(
            _final_state(out, "bf16_master"), _final_state(tmp_path / "whole", "bf16_master")
        )


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""
    return captured.err


def _started(out: Path, capsys: pytest.CaptureFixture[str], policy: str = "fp32") -> None:
    """A finished 4-step run in `out`."""
    assert main(["train", *TINY, "--policy", policy, "--steps", "4", "--out", str(out)]) == 0
    capsys.readouterr()


def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    base = ["train", *TINY, "--steps", "4"]
    cases: list[tuple[list[str], str]] = [
        (
            [*base, "--policy", "bf16_mastr", "--out", str(run)],
            "unknown precision policy 'bf16_mastr' (did you mean 'bf16_master'?)",
        ),
        ([*base, "--policy", "fp32", "--steps", "0", "--out", str(run)], "steps must be"),
        (["train", *TINY, "--out", str(run)], "names no policy"),
        ([*base, "--policy", "fp32", "--out", str(run), "--resume"], "nothing to resume"),
        ([*base, "--policy", "fp32", "--out", str(run), "--stop-after", "0"], "--stop-after"),
        ([*base, "--policy", "fp32", "--out", str(run), "--resume", "newest"], "invalid choice"),
    ]
    (tmp_path / "file").write_text("")
    cases.append(([*base, "--policy", "fp32", "--out", str(tmp_path / "file")], "not a folder"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("policy: fp32\nworkload: digits\nstepz: 4\n")
    cases.append((["train", "--config", str(recipe), "--out", str(run)], "unknown recipe keys"))
    imports = tmp_path / "imports.yaml"
    imports.write_text("policy: fp32\nworkload: os:system\n")
    cases.append((["train", "--config", str(imports), "--out", str(run)], "only name built-in"))
    for argv, expected in cases:
        assert expected in _one_line_exit_2(argv, capsys), argv
    assert not run.exists()  # refused before anything was written


def test_resume_refuses_another_policy_other_settings_and_a_damaged_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _started(run, capsys)
    again = ["train", *TINY, "--policy", "fp32", "--steps", "4", "--out", str(run)]
    assert "already holds a run" in _one_line_exit_2(again, capsys)
    err = _one_line_exit_2(["train", "--out", str(run), "--resume", "--policy", "amp_bf16"], capsys)
    assert (
        "trained under policy 'fp32'" in err and "compute_dtype (saved 'none', now 'bf16')" in err
    )
    err = _one_line_exit_2(["train", "--out", str(run), "--resume", "--seed", "1"], capsys)
    assert "seed (saved 0, now 1)" in err
    data = run / "checkpoints" / "step_00000004" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 1
    data.write_bytes(bytes(blob))
    err = _one_line_exit_2(["train", "--out", str(run), "--resume"], capsys)
    assert "corrupt" in err and "--resume latest-valid" in err


def _compare_folder(
    folder: Path,
    recommended: str | None,
    *,
    workload: str = "digits",
    size: str | None = "tiny",
    train: dict[str, object] | None = None,
) -> Path:
    """The parts of a finished `mixprec compare --out` folder that --policy-from reads."""
    folder.mkdir()
    contract = Contract(
        workload=workload, size=size, candidates=("bf16_master",), seeds=1, train=train or {}
    )
    decision = {"recommended": recommended, "too_short": "", "baseline_reason": ""}
    results = {"workload": workload, "contract": contract.to_dict(), "decision": decision}
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def test_policy_from_takes_the_recommendation_and_refuses_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chosen = _compare_folder(tmp_path / "cmp", "bf16_master")
    out = tmp_path / "run"
    argv = ["train", "--policy-from", str(chosen), "--steps", "3", "--out", str(out), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --json: no progress, no findings
    summary = json.loads(captured.out)
    assert summary["policy"] == "bf16_master"
    assert summary["workload"] == "digits" and summary["recipe"]["size"] == "tiny"  # as compared
    edited = _compare_folder(tmp_path / "edited", "fp8_rowwise")  # never a candidate
    err = _one_line_exit_2(["train", "--policy-from", str(edited), "--out", str(out)], capsys)
    assert "recommends 'fp8_rowwise', which its contract did not compare" in err
    nothing = _compare_folder(tmp_path / "none", None)
    err = _one_line_exit_2(["train", "--policy-from", str(nothing), "--out", str(out)], capsys)
    assert f"{nothing}: compare recommended no policy" in err
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    err = _one_line_exit_2(["train", "--policy-from", str(unfinished), "--out", str(out)], capsys)
    assert "results.json does not exist" in err


def test_policy_from_trains_the_compared_workload_and_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in issue 30: after a compare of a `module:function` workload, `train
    --policy-from` trained the built-in Shakespeare model without a word."""
    monkeypatch.syspath_prepend(str(HERE))
    spec = "signal_workload:make_workload"  # tiny digits
    compared = {"steps": 3, "lr": 0.02, "batch_size": 16}
    folder = _compare_folder(
        tmp_path / "cmp", "bf16_master", workload=spec, size=None, train=compared
    )
    argv = ["train", "--policy-from", str(folder), "--json"]
    assert main([*argv, "--workload", spec, "--out", str(tmp_path / "a")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["recipe"]["workload"] == spec and summary["policy"] == "bf16_master"
    assert {k: summary["settings"][k] for k in compared} == compared
    assert summary["step"] == 3
    # Flags win over the compared settings: a longer run of what was compared.
    assert main([*argv, "--workload", spec, "--steps", "4", "--out", str(tmp_path / "b")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 4 and summary["settings"]["lr"] == 0.02
    # A folder never names code to import: the command line names it again.
    err = _one_line_exit_2([*argv, "--out", str(tmp_path / "c")], capsys)
    assert f"compared the workload {spec!r}" in err and f"--workload {spec}" in err
    # Another workload than the compared one is refused, naming both ways on.
    err = _one_line_exit_2([*argv, *TINY, "--out", str(tmp_path / "c")], capsys)
    assert f"{folder} compared the workload {spec!r}, not 'digits'" in err
    assert "--policy bf16_master" in err
    assert not (tmp_path / "c").exists()


def test_resume_of_a_folder_without_a_run_says_nothing_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in issue 30: `--out EMPTY_DIR --resume` said 'the recipe names no policy'."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, tmp_path / "absent"):
        err = _one_line_exit_2(["train", "--out", str(out), "--resume"], capsys)
        assert err.startswith(f"mixprec: error: nothing to resume: {out} holds no run"), err
        assert "start without --resume" in err


def test_a_yaml_recipe_trains_what_the_flags_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [*TINY, "--policy", "bf16-mixed", "--steps", "5", "--seed", "2", "--eval-every", "2"]
    assert main(["train", *flags, "--out", str(tmp_path / "flags")]) == 0
    # One file for both commands: compare reads `compare:`, train reads `train:`.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "compare:\n  workload: digits\n  size: tiny\n  steps: 5\n"
        "train:\n  workload: digits\n  size: tiny\n  policy: amp_bf16\n  steps: 5\n"
        "  seed: 2\n  eval_every: 2\n  lr: 1e-2\n"
    )
    assert main(["train", "--config", str(recipe), "--out", str(tmp_path / "yaml")]) == 0
    capsys.readouterr()
    stored = [json.loads((tmp_path / d / "recipe.json").read_text()) for d in ("flags", "yaml")]
    assert stored[1] == {**stored[0], "lr": 0.01}  # the tiny preset's own lr, restated
    assert _metrics(tmp_path / "flags") == _metrics(tmp_path / "yaml")
    # Flags override the file.
    assert (
        main(["train", "--config", str(recipe), "--steps", "3", "--out", str(tmp_path / "o")]) == 0
    )
    assert len(_metrics(tmp_path / "o")) == 3


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--optimizer", "rmsprop"], "optimizer 'rmsprop' is not one of adamw, adam, sgd, lion"),
        (["--optimizer", "sgd"], "optimizer sgd needs a learning rate"),
        (["--optimizer-args", "momentum=0.9"], "'momentum' is not an argument of adamw"),
        (["--optimizer", "lion", "--optimizer-args", "lr=fast"], "lr='fast' is not a number"),
    ],
)
def test_bad_optimizer_flags_exit_2_with_one_line(
    flags: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", *TINY, "--policy", "fp32", "--steps", "2", "--out", str(tmp_path / "r")]
    assert expected in _one_line_exit_2([*argv, *flags], capsys)
    assert not (tmp_path / "r").exists()


def test_a_run_trains_its_optimizer_and_resume_refuses_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    sgd = ["--optimizer", "sgd", "--optimizer-args", "lr=0.05,momentum=0.9"]
    argv = ["train", *TINY, "--policy", "bf16_master", "--steps", "4", "--out", str(run)]
    assert main([*argv, *sgd, "--stop-after", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["optimizer"] == "sgd (momentum=0.9)" and summary["settings"]["lr"] == 0.05
    assert summary["recipe"]["optimizer_args"] == {"momentum": 0.9}
    lion = ["--optimizer", "lion", "--optimizer-args", "lr=0.05"]
    err = _one_line_exit_2(["train", "--out", str(run), "--resume", *lion], capsys)
    assert "was trained with optimizer sgd (mixprec.optim.SGD), this run asks for lion" in err
    # Found by review: without new arguments the saved ones (momentum=0.9) met Lion and
    # the refusal named an argument the user never typed; the class is refused first.
    err = _one_line_exit_2(["train", "--out", str(run), "--resume", "--optimizer", "lion"], capsys)
    assert "was trained with optimizer sgd (mixprec.optim.SGD), this run asks for lion" in err
    resumed = ["train", "--out", str(run), "--resume", "--optimizer-args", "lr=0.05,momentum=0.8"]
    err = _one_line_exit_2(resumed, capsys)
    assert "optimizer (saved sgd (momentum=0.9), now sgd (momentum=0.8))" in err
    assert main(["train", "--out", str(run), "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 4 and summary["optimizer"] == "sgd (momentum=0.9)"


def test_policy_from_trains_the_compared_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "cmp"
    folder.mkdir()
    contract = Contract(
        workload="digits",
        size="tiny",
        candidates=("bf16_master",),
        optimizer="sgd",
        optimizer_args="lr=0.05,momentum=0.9",
    )
    results = {"contract": contract.to_dict(), "decision": {"recommended": "bf16_master"}}
    (folder / "results.json").write_text(json.dumps(results))
    argv = ["train", "--policy-from", str(folder), "--steps", "2", "--json"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["optimizer"] == "sgd (momentum=0.9)" and summary["settings"]["lr"] == 0.05
    err = _one_line_exit_2([*argv, "--optimizer", "adamw", "--out", str(tmp_path / "b")], capsys)
    assert f"{folder} judged policies for optimizer sgd, not adamw" in err
