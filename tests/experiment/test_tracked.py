"""What compare and train log to a tracker, read back with MLflow's and TensorBoard's own
readers; a tracker that fails never costs the run."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import mixprec
from mixprec.experiment import Contract
from mixprec.experiment.tracked import TRACKING_FILE
from mixprec.tracking import TrackedRun, open_tracker

#: The smallest compare: the tiny digits model, one seed, a few steps.
SMALL: dict[str, Any] = dict(
    size="tiny", seeds=1, max_seeds=1, steps=8, eval_every=4, progress=False
)


@pytest.fixture
def file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A file-store URI; MLflow's file-store opt-in that the tracker sets is undone after."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "x")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return (tmp_path / "mlruns").as_uri()


def _runs(uri: str) -> tuple[Any, list[Any]]:
    mlflow = pytest.importorskip("mlflow")
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("mixprec")
    return client, client.search_runs([experiment.experiment_id])


@pytest.mark.slow
def test_compare_nested_runs_hold_each_runs_steps_as_its_record_does(
    tmp_path: Path, file_store: str
) -> None:
    pytest.importorskip("mlflow")
    results = mixprec.compare(
        "digits",
        ["amp_fp16"],
        out=tmp_path / "cmp",
        track="mlflow",
        track_uri=file_store,
        step_caps={},
        **SMALL,
    )
    client, runs = _runs(file_store)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert results.tracked.endswith(f"run {parent.info.run_id}")
    for record in results.records:
        child = next(r for r in runs if r.info.run_name == f"{record.policy}-seed0")
        run_id = child.info.run_id
        loss = client.get_metric_history(run_id, "train_loss")
        assert [(m.step - 1, m.value) for m in loss] == [tuple(p) for p in record.loss_curve]
        heldout = client.get_metric_history(run_id, "heldout_loss")
        assert [(m.step, m.value) for m in heldout] == [tuple(p) for p in record.eval_curve]
        assert child.data.params["policy_fields.master"] == str(record.policy_fields["master"])
        assert child.data.metrics["memory_bytes.total"] == record.bytes["total"]
        steps_per_s = client.get_metric_history(run_id, "steps_per_s")
        assert steps_per_s[-1].value == pytest.approx(record.throughput["steps_per_s"])
    scaled = next(r for r in runs if r.info.run_name == "amp_fp16-seed0")
    scale = client.get_metric_history(scaled.info.run_id, "loss_scale")
    assert len(scale) == 8 and scale[0].value == 65536.0  # amp_fp16's initial scale
    unscaled = next(r for r in runs if r.info.run_name == "fp32-seed0")
    assert client.get_metric_history(unscaled.info.run_id, "loss_scale") == []

    # A rerun into the folder reuses both records: its nested runs are logged from them.
    again = mixprec.compare(
        "digits",
        ["amp_fp16"],
        out=tmp_path / "cmp",
        track="mlflow",
        track_uri=file_store,
        step_caps={},
        **SMALL,
    )
    _, runs = _runs(file_store)
    reused = [r for r in runs if r.data.tags.get("mixprec.reused") == "true"]
    assert sorted(r.info.run_name for r in reused) == ["amp_fp16-seed0", "fp32-seed0"]
    parents = {r.data.tags["mlflow.parentRunId"] for r in reused}
    assert parents == {again.tracked.rsplit(" ", 1)[-1]}
    assert all(r.info.status == "FINISHED" for r in runs)


def test_compare_to_tensorboard(tmp_path: Path) -> None:
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    results = mixprec.compare(
        "digits", ["amp_bf16"], out=tmp_path / "cmp", track="tensorboard", **SMALL
    )
    logdir = tmp_path / "cmp" / "tensorboard"
    (parent,) = logdir.iterdir()
    assert results.tracked == f"TensorBoard log dir {logdir} (run {parent.name})"
    acc = ea.EventAccumulator(str(parent), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    ratio = acc.Scalars("amp_bf16.memory_ratio")[0].value
    summary = results.decision.summary("amp_bf16")
    base = results.decision.summary("fp32")
    assert ratio == pytest.approx(summary.total_bytes / base.total_bytes)
    tags = acc.Tensors("tags/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert f"| verdict.amp_bf16 | {results.decision.verdicts['amp_bf16'].status} |" in tags
    report = acc.Tensors("artifacts/report.md/text_summary")[0].tensor_proto.string_val[0]
    assert report.decode() == results.report.markdown.read_text(encoding="utf-8")
    assert (parent / "artifacts" / "results.json").read_bytes() == (
        results.report.results_json.read_bytes()
    )
    nested = ea.EventAccumulator(str(parent / "amp_bf16-seed0"), size_guidance={"scalars": 0})
    nested.Reload()
    record = next(r for r in results.records if r.policy == "amp_bf16")
    assert [e.value for e in nested.Scalars("train_loss")] == pytest.approx(
        [v for _, v in record.loss_curve]
    )


class _FailingRun:
    """A run whose metrics fail after `ok` calls, as a full disk would."""

    def __init__(self, state: dict[str, int]) -> None:
        self.state = state
        self.run_id = "r"
        self.where = "fake"

    def log_params(self, params: Mapping[str, Any]) -> None:
        return None

    def log_metrics(self, metrics: Mapping[str, Any], *, step: int) -> None:
        self.state["metrics"] += 1
        if self.state["metrics"] > 5:
            raise OSError(28, "No space left on device")

    def set_tags(self, tags: Mapping[str, str]) -> None:
        return None

    def log_artifact(self, path: Path, *, folder: str = "") -> None:
        return None

    def child(self, name: str, *, tags: Mapping[str, str] | None = None) -> TrackedRun:
        return self

    def end(self, status: str = "FINISHED") -> None:
        self.state["ended"] += 1


class _FailingTracker:
    name = "fake"
    uri = "fake://"

    def __init__(self) -> None:
        self.state = {"metrics": 0, "ended": 0}

    def start_run(self, name: str, **kw: Any) -> TrackedRun:
        return _FailingRun(self.state)


def test_a_tracker_failure_warns_once_and_the_experiment_completes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _FailingTracker()
    results = mixprec.compare("digits", ["amp_bf16"], out=tmp_path / "cmp", track=fake, **SMALL)
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "tracking" in line] == [
        "mixprec: warning: tracking to fake failed (OSError: [Errno 28] No space left on "
        "device); training goes on without it, the run's own files are complete"
    ]
    assert fake.state["metrics"] == 6 and fake.state["ended"] == 0  # nothing after the failure
    assert len(results.records) == 2 and results.report.html.is_file()
    assert results.tracked == ""
    plain = mixprec.compare("digits", ["amp_bf16"], out=tmp_path / "plain", **SMALL)
    assert [r.heldout_loss for r in results.records] == [r.heldout_loss for r in plain.records]


def test_train_logs_metrics_jsonl_and_resume_goes_on_with_the_same_run(
    tmp_path: Path, file_store: str
) -> None:
    pytest.importorskip("mlflow")
    recipe = {
        "workload": "digits",
        "size": "tiny",
        "policy": "amp_fp16",
        "steps": 8,
        "save_every": 4,
        "eval_every": 4,
    }
    out = tmp_path / "run"
    tracker = open_tracker("mlflow", out=out, uri=file_store)
    first = mixprec.train(recipe, out, stop_after=4, stream=None, tracker=tracker)
    assert not first.finished
    client, runs = _runs(file_store)
    (run,) = runs
    assert run.info.status == "KILLED" and run.data.tags["mixprec.status"] == "stopped"
    assert run.data.tags["mixprec.checkpoint"] == str(first.checkpoint.resolve())
    stored = json.loads((out / TRACKING_FILE).read_text(encoding="utf-8"))
    assert stored == {"tracker": "mlflow", "uri": file_store, "run_id": run.info.run_id}

    tracker = open_tracker("mlflow", out=out, uri=file_store)
    done = mixprec.train(recipe, out, resume="latest", stream=None, tracker=tracker)
    _, runs = _runs(file_store)
    (run,) = runs  # the same run, not a second one
    assert run.info.status == "FINISHED" and run.data.tags["mixprec.resumed_at"] == "4"
    assert done.summary["tracked"].endswith(f"run {run.info.run_id}")
    lines = [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "lr", "loss_scale", "grad_norm", "skipped"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [
            (line["step"], float(line[key])) for line in lines
        ], key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [4, 8]
    params = run.data.params
    assert params["policy_fields.loss_scaling.init_scale"] == "65536.0"
    assert params["recipe.steps"] == "8" and params["settings.steps"] == "8"
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"train.json", "recipe.json"}  # checkpoints are not uploaded


def test_train_to_tensorboard(tmp_path: Path) -> None:
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "run"
    recipe = {"workload": "digits", "size": "tiny", "policy": "bf16_master", "steps": 6}
    result = mixprec.train(recipe, out, stream=None, tracker=open_tracker("tensorboard", out=out))
    (folder,) = (out / "tensorboard").iterdir()
    acc = ea.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    lines = [json.loads(t) for t in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (line["step"], pytest.approx(line["loss"])) for line in lines
    ]
    assert (
        result.summary["tracked"]
        == f"TensorBoard log dir {out / 'tensorboard'} (run {folder.name})"
    )


def test_no_tracker_writes_no_tracking_file(tmp_path: Path) -> None:
    recipe = {"workload": "digits", "size": "tiny", "policy": "fp32", "steps": 2}
    result = mixprec.train(recipe, tmp_path, stream=None)
    assert result.summary["tracked"] is None and not (tmp_path / TRACKING_FILE).exists()


def test_the_contract_is_logged_flat_on_the_parent(tmp_path: Path, file_store: str) -> None:
    pytest.importorskip("mlflow")
    contract = Contract(
        workload="digits",
        size="tiny",
        candidates=("amp_bf16",),
        seeds=1,
        max_seeds=1,
        train={"steps": 6},
        step_caps={},
        target_device="cuda",
    )
    results = mixprec.experiment.run_contract(
        contract,
        tmp_path / "cmp",
        stream=None,
        tracker=open_tracker("mlflow", out=tmp_path, uri=file_store),
    )
    _, runs = _runs(file_store)
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    params = parent.data.params
    assert params["contract.gates.confidence"] == str(contract.gates.confidence)
    assert params["contract.candidates"] == '["amp_bf16"]'
    assert params["settings.steps"] == "6"
    tags = parent.data.tags
    assert tags["mixprec.recommended"] == str(results.recommended or "none")
    assert tags["mixprec.status"] == results.decision.status  # pending_target is not "none"
    assert (tags["mixprec.objective"], tags["mixprec.target_device"]) == ("balanced", "cuda")
    verdict = results.decision.verdicts["amp_bf16"]
    assert (tags["verdict.amp_bf16"], tags["verdict.amp_bf16.gate"]) == (
        verdict.status,
        verdict.gate,
    )


def test_an_interrupted_compare_ends_its_runs_killed(tmp_path: Path, file_store: str) -> None:
    pytest.importorskip("mlflow")
    contract = Contract(
        workload="digits",
        size="tiny",
        candidates=("amp_bf16",),
        seeds=1,
        max_seeds=1,
        train={"steps": 6},
        step_caps={},
    )
    polls = iter(range(100))
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C at the 4th step of the first run
        mixprec.experiment.run_contract(
            contract,
            tmp_path / "cmp",
            stream=None,
            should_stop=lambda: next(polls) >= 3,
            tracker=open_tracker("mlflow", out=tmp_path, uri=file_store),
        )
    _, runs = _runs(file_store)
    assert sorted((r.info.run_name, r.info.status) for r in runs) == [
        ("compare-digits", "KILLED"),
        ("fp32-seed0", "KILLED"),
    ]
