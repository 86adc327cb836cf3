"""`--track` on the command line: a compare read back with MLflow's client from the
default ./mlruns, bad input, a missing extra, and a data-parallel train logged by rank 0."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.cli import main

from .test_train import _env

TINY = ["--workload", "digits", "--size", "tiny", "--seeds", "1", "--max-seeds", "1"]


def test_compare_logged_to_the_default_mlruns_is_read_back_with_mlflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "x")  # set by the tracker; undone after
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    argv = ["compare", *TINY, "--policies", "bf16_master", "--steps", "8", "--out", "cmp"]
    code = main([*argv, "--quiet", "--track", "mlflow"])
    assert code in (0, 1)
    out = capsys.readouterr().out.splitlines()
    uri = (tmp_path / "mlruns").as_uri()
    assert out[-1].startswith(f"tracked: MLflow {uri}, experiment 'mixprec', run ")
    parent_id = out[-1].rsplit(" ", 1)[-1]

    client = mlflow.MlflowClient(tracking_uri=uri)
    parent = client.get_run(parent_id)
    results = json.loads((tmp_path / "cmp" / "results.json").read_text(encoding="utf-8"))
    assert parent.info.status == "FINISHED" and parent.info.run_name == "compare-digits"
    assert parent.data.params["contract.baseline"] == "fp32"
    assert parent.data.params["contract.candidates"] == '["bf16_master"]'
    assert parent.data.tags["mixprec.recommended"] == str(
        results["decision"]["recommended"] or "none"
    )
    gap = results["decision"]["policies"]["bf16_master"]["gap_mean"]
    assert parent.data.metrics["bf16_master.gap_mean"] == pytest.approx(gap)
    assert "bf16_master.memory_ratio" in parent.data.metrics
    artifacts = {f.path for f in client.list_artifacts(parent_id)}
    assert {"results.json", "report.md", "report.html", "contract.json", "plots"} <= artifacts
    plots = {f.path for f in client.list_artifacts(parent_id, "plots")}
    assert plots == {f"plots/{p.name}" for p in (tmp_path / "cmp" / "plots").iterdir()}
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    assert sorted(r.info.run_name for r in children) == ["bf16_master-seed0", "fp32-seed0"]
    for child in children:
        assert child.data.params["policy_fields.name"] == child.data.tags["mixprec.policy"]
        assert len(client.get_metric_history(child.info.run_id, "train_loss")) == 8
        name = child.info.run_name
        assert [f.path for f in client.list_artifacts(child.info.run_id)] == [f"{name}.json"]


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.out == "", captured
    return captured.err


@pytest.mark.parametrize("command", ["compare", "train"])
def test_a_missing_extra_exits_2_with_the_install_line(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    err = _one_line_exit_2([command, "--out", str(tmp_path / "o"), "--track", "mlflow"], capsys)
    assert err == (
        "mixprec: error: tracking to mlflow needs the mlflow package: "
        "pip install 'mixprec[mlflow]'\n"
    )
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_track_uri_without_track_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _one_line_exit_2(["train", "--out", str(tmp_path), "--track-uri", "x"], capsys)
    assert "--track-uri needs --track mlflow or --track tensorboard" in err
    err = _one_line_exit_2(["compare", "--track", "wandb"], capsys)
    assert "invalid choice: 'wandb'" in err
    err = _one_line_exit_2(["compare", "--track", "tensorboard", "--track-uri", " "], capsys)
    assert "--track-uri is empty" in err


@pytest.mark.slow
def test_only_rank_0_logs_a_data_parallel_train(tmp_path: Path) -> None:
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "dp"
    argv = ["train", "--workload", "digits", "--size", "tiny", "--policy", "fp32"]
    argv += ["--steps", "4", "--nproc", "2", "--out", str(out), "--track", "tensorboard"]
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", *argv],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (folder,) = (out / "tensorboard").iterdir()  # one run, not one per rank
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    acc = ea.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    lines = [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (line["step"], pytest.approx(line["loss"])) for line in lines
    ]
    assert f"tracked: TensorBoard log dir {out / 'tensorboard'}" in proc.stdout


def test_compare_json_says_where_it_was_tracked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "cmp"
    argv = ["compare", *TINY, "--policies", "bf16_master", "--steps", "4", "--out", str(out)]
    assert main([*argv, "--json", "--track", "tensorboard"]) in (0, 1)
    captured = capsys.readouterr()
    assert captured.err == "", "--json is quiet on stderr, as train's is"
    data = json.loads(captured.out)
    assert data["tracked"].startswith(f"TensorBoard log dir {out / 'tensorboard'} (run compare-")
    on_disk = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert {k: v for k, v in data.items() if k != "tracked"} == on_disk
    assert main([*argv, "--quiet", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["tracked"] is None
