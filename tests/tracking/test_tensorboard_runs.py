"""The TensorBoard backend, read back with TensorBoard's own event reader."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mixprec.tracking import open_tracker, tracker_failed

EventAccumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator"
).EventAccumulator


def _events(folder: Path) -> Any:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def _texts(acc: Any, tag: str) -> list[str]:
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


def test_scalars_text_params_artifacts_and_a_nested_run(tmp_path: Path) -> None:
    tracker = open_tracker("tensorboard", out=tmp_path)
    run = tracker.start_run("compare-digits", tags={"mixprec.command": "compare"})
    run.log_params({"contract": {"seeds": 2, "note": "a|b"}})
    run.log_metrics({"fp32.gap_mean": 0.0, "bad": None}, step=0)
    child = run.child("fp32-seed0")
    for step in range(1, 6):
        child.log_metrics({"train_loss": 1.0 / step}, step=step)
    child.end()
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    plots = tmp_path / "plots"
    plots.mkdir()
    fig = plt.figure(figsize=(1, 1), dpi=20)
    fig.savefig(plots / "loss.png")
    plt.close(fig)
    (tmp_path / "report.md").write_text("# mixprec compare\n\nrecommended: fp32", "utf-8")
    run.log_artifact(tmp_path / "report.md")
    run.log_artifact(plots)
    run.end()
    assert not tracker_failed(tracker)

    folder = tmp_path / "tensorboard" / run.run_id
    assert run.run_id.startswith("compare-digits-")
    assert run.where == f"TensorBoard log dir {tmp_path / 'tensorboard'} (run {run.run_id})"
    acc = _events(folder)
    assert [e.value for e in acc.Scalars("fp32.gap_mean")] == [0.0]
    assert "bad" not in acc.Tags()["scalars"]
    assert _texts(acc, "params") == [
        "| key | value |\n| --- | --- |\n| contract.seeds | 2 |\n| contract.note | a\\|b |"
    ]
    assert "| mixprec.command | compare |" in _texts(acc, "tags")[0]
    assert _texts(acc, "artifacts/report.md") == ["# mixprec compare\n\nrecommended: fp32"]
    assert _texts(acc, "status") == ["FINISHED"]
    image = acc.Images("artifacts/plots/loss.png")[0]
    assert (image.width, image.height) == (20, 20)
    assert (folder / "artifacts" / "plots" / "loss.png").is_file()
    nested = _events(folder / "fp32-seed0")
    assert [(e.step, e.value) for e in nested.Scalars("train_loss")] == [
        (s, pytest.approx(1.0 / s)) for s in range(1, 6)
    ]


def test_resume_drops_points_logged_after_the_checkpoint(tmp_path: Path) -> None:
    tracker = open_tracker("tensorboard", out=tmp_path, uri=str(tmp_path / "tb"))
    run = tracker.start_run("train-digits")
    for step in range(1, 8):  # checkpoint at 5, stopped (crashed) at 7
        run.log_metrics({"loss": float(step)}, step=step)
    run.end("KILLED")
    # Event files are read in name order, and a name is "<seconds>.<host>.<pid>.<counter>":
    # within one second of one process a counter past 9 sorts "10" before "9". A real
    # resume is a new process, seconds later; so is this one.
    time.sleep(1.1)
    again = tracker.start_run("train-digits", resume=run.run_id, resume_step=5)
    assert again.run_id == run.run_id
    for step in range(6, 9):
        again.log_metrics({"loss": 10.0 * step}, step=step)
    again.end()
    acc = _events(tmp_path / "tb" / run.run_id)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 5.0),
        (6, 60.0),
        (7, 70.0),
        (8, 80.0),
    ]
