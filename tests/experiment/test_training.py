"""`mixprec.train`: the long-run loop. A run stopped and resumed is bitwise the run that
was never stopped, for every preset; checkpoints, metrics.jsonl and the summary say so."""

from __future__ import annotations

import dataclasses
import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec.checkpoint import CheckpointError, CheckpointWarning, list_checkpoints, load
from mixprec.checkpoint.layout import manifest_digest
from mixprec.engine import Precision
from mixprec.experiment import Recipe, TrainResult, train
from mixprec.experiment.metrics_log import read_metrics
from mixprec.policy import PRESET_NAMES, preset
from mixprec.workloads import load_workload

#: 8 steps of tiny digits: checkpoints every 3 steps, evaluations every 4.
BASE: dict[str, Any] = {
    "workload": "digits",
    "size": "tiny",
    "steps": 8,
    "eval_every": 4,
    "save_every": 3,
}


def _recipe(policy: str = "bf16_master", **changes: Any) -> Recipe:
    return Recipe.from_dict({**BASE, "policy": policy, **changes})


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in line.items() if k != "elapsed_s"}
        for line in read_metrics(out / "metrics.jsonl")
    ]


def final_state(checkpoint: Path, policy: str) -> dict[str, torch.Tensor]:
    """Model, optimizer and loss-scaler tensors of a checkpoint (a root: its latest)
    of a `digits` tiny run; shared with the command line's tests."""
    workload = load_workload("digits", size="tiny")
    prec = Precision(policy)
    model = workload.make_model(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec.prepare(model)
        optimizer = prec.optimizer(model, seed=0)
    load(checkpoint, model=model, optimizer=optimizer, precision=prec, restore_rng=False)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        flat.update({f"optimizer.{index}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    flat["scale"] = torch.tensor(prec.stats.loss_scale or 0.0, dtype=torch.float64)
    return flat


def _final_state(result: TrainResult, policy: str) -> dict[str, torch.Tensor]:
    assert result.checkpoint is not None
    return final_state(result.checkpoint, policy)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key].detach().reshape(-1), b[key].detach().reshape(-1)
        assert x.dtype == y.dtype, key
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), key


@pytest.mark.parametrize("policy", PRESET_NAMES)
def test_every_preset_stopped_and_resumed_is_bitwise_the_uninterrupted_run(
    policy: str, tmp_path: Path
) -> None:
    # (a policy that releases gradients cannot clip them: inf clips nothing)
    unclipped = {"grad_clip_norm": float("inf")} if preset(policy).release_gradients else {}
    recipe = _recipe(policy, **unclipped)
    whole = train(recipe, tmp_path / "whole", stream=None)
    first = train(recipe, tmp_path / "parts", stream=None, stop_after=5)
    assert not first.finished and first.step == 5
    assert first.checkpoint == tmp_path / "parts" / "checkpoints" / "step_00000005"
    assert first.summary["status"] == "stopped" and first.summary["export"] is None
    rest = train(recipe, tmp_path / "parts", stream=None, resume="latest")
    assert whole.finished and rest.finished and rest.step == whole.step == 8
    assert _metrics(tmp_path / "whole") == _metrics(tmp_path / "parts")
    _assert_bitwise(_final_state(whole, policy), _final_state(rest, policy))
    assert rest.summary["final"] == whole.summary["final"]
    assert rest.summary["skipped_steps"] == whole.summary["skipped_steps"]
    exported = [out / "export" / "model.safetensors" for out in (whole.out, rest.out)]
    assert exported[0].read_bytes() == exported[1].read_bytes()


def test_metrics_summary_checkpoints_and_export(tmp_path: Path) -> None:
    result = train(_recipe("amp_fp16", keep_last=2), tmp_path, stream=None)
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert {"loss", "lr", "loss_scale", "skipped", "grad_norm", "elapsed_s"} <= lines[0].keys()
    assert lines[0]["loss_scale"] == 65536.0 and lines[0]["skipped"] is False
    assert [line["step"] for line in lines if "eval_loss" in line] == [4, 8]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000006",
        "step_00000008",
    ]  # every 3 steps and the last, the newest 2 kept
    summary = json.loads((tmp_path / "train.json").read_text())
    assert summary == result.summary
    assert summary["status"] == "finished" and summary["policy"] == "amp_fp16"
    assert summary["final"] == {
        "step": 8,
        "eval_loss": lines[-1]["eval_loss"],
        "eval_metric": lines[-1]["eval_metric"],
    }
    ckpt = summary["checkpoint"]
    assert ckpt["path"] == "checkpoints/step_00000008" and ckpt["step"] == 8
    assert ckpt["components"]["model.params"] > 0 and ckpt["bytes"] > 0
    assert summary["predicted_bytes"]["total"] > 0
    assert summary["export"] == {"path": "export", "dtype": "fp32"}
    assert (tmp_path / "export").is_dir()
    assert Recipe.from_dict(json.loads((tmp_path / "recipe.json").read_text())) == _recipe(
        "amp_fp16", keep_last=2
    )


def test_resume_cuts_metrics_back_and_latest_valid_skips_a_damaged_checkpoint(
    tmp_path: Path,
) -> None:
    recipe = _recipe(save_every=2)
    whole = train(recipe, tmp_path / "whole", stream=None)
    parts = tmp_path / "parts"
    train(recipe, parts, stream=None, stop_after=5)  # checkpoints 2, 4, 5
    with (parts / "metrics.jsonl").open("a") as f:  # a crash after step 6, inside step 7's line
        f.write('{"step": 6, "loss": 0.0}\n{"step": 7, "lo')
    data = parts / "checkpoints" / "step_00000005" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="corrupt"):
        train(recipe, parts, stream=None, resume="latest")
    with pytest.warns(CheckpointWarning, match="skipped a checkpoint"):
        rest = train(recipe, parts, stream=None, resume="latest-valid")
    assert _metrics(parts) == _metrics(tmp_path / "whole")  # cut back to step 4, then 5..8
    _assert_bitwise(_final_state(whole, "bf16_master"), _final_state(rest, "bf16_master"))


def test_should_stop_ends_the_run_after_the_step_in_progress(tmp_path: Path) -> None:
    polls: list[int] = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) > 3

    result = train(_recipe(), tmp_path, stream=None, should_stop=should_stop)
    assert result.step == 3 and not result.finished
    assert result.checkpoint == tmp_path / "checkpoints" / "step_00000003"
    assert json.loads((tmp_path / "train.json").read_text())["status"] == "stopped"
    again = train(_recipe(), tmp_path, stream=None, resume="latest", stop_after=100)
    assert again.finished and again.summary["steps_this_call"] == 5
    done = train(_recipe(), tmp_path, stream=None, resume="latest")  # after the last step
    assert done.finished and done.summary["steps_this_call"] == 0
    assert done.summary["final"] == again.summary["final"]


def test_resume_refuses_other_policies_settings_and_runs(tmp_path: Path) -> None:
    train(_recipe(), tmp_path, stream=None, stop_after=2)
    with pytest.raises(ValueError, match="already holds a run"):
        train(_recipe(), tmp_path, stream=None)
    with pytest.raises(ValueError, match=r"differing fields: .*master \(saved 'exact', now 'none'"):
        train(_recipe("bf16_pure"), tmp_path, stream=None, resume="latest")
    with pytest.raises(ValueError, match=r"belongs to another run: lr \(saved 0\.01, now 0\.02\)"):
        train(_recipe(lr=0.02), tmp_path, stream=None, resume="latest")
    tiny = load_workload("digits", size="tiny")
    other = dataclasses.replace(tiny, config={**tiny.config, "split_seed": 1})
    with pytest.raises(ValueError, match=r"workload_config \(saved"):
        train(_recipe(), tmp_path, stream=None, resume="latest", workload=other)
    with pytest.raises(ValueError, match="nothing to resume"):
        train(_recipe(), tmp_path / "empty", stream=None, resume="latest")
    # How it is observed may change: cadences are not the run's numbers.
    observed = _recipe(eval_every=1, save_every=5)
    assert train(observed, tmp_path, stream=None, resume="latest").finished


def test_findings_are_printed_once_as_they_appear(tmp_path: Path) -> None:
    stream = io.StringIO()
    # bf16 storage without a master and a tiny learning rate: updates vanish.
    recipe = _recipe("bf16_pure", steps=20, lr=1e-6, min_lr=1e-7, probe_every=1)
    result = train(recipe, tmp_path, stream=stream)
    text = stream.getvalue()
    assert (
        "mixprec train: digits (tiny), policy bf16_pure, optimizer adamw, 20 steps, seed 0" in text
    )
    assert "doctor: error optimizer-state-16bit" in text  # static, before the first step
    assert text.count("doctor: error vanishing-updates") == 1  # seen at run time
    assert {f["rule"] for f in result.summary["doctor"]} == {
        "optimizer-state-16bit",
        "vanishing-updates",
    }


def test_a_checkpoint_saved_before_a_policy_field_existed_resumes(tmp_path: Path) -> None:
    """A field added since (grad_accum_dtype) is missing from older checkpoints: it had
    its default then, so the resume (and the checkpoint's own policy check) go on."""
    train(_recipe(), tmp_path, stream=None, stop_after=2)
    manifests = list(tmp_path.rglob("manifest.json"))
    assert manifests
    for path in manifests:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        assert manifest["policy"].pop("grad_accum_dtype") == "none"
        manifest["manifest_sha256"] = manifest_digest(manifest)  # as an older version wrote it
        path.write_text(json.dumps(manifest), encoding="utf-8")
    assert train(_recipe(), tmp_path, stream=None, resume="latest").finished
