"""Damaged, foreign and malicious checkpoints are refused with one line naming the file."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from tests.checkpoint import loop

import mixprec
from mixprec import checkpoint
from mixprec.checkpoint import CheckpointError, CheckpointWarning
from mixprec.checkpoint.files import file_digest
from mixprec.checkpoint.layout import manifest_digest


def _two_checkpoints(root: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model, optimizer, prec = loop.build("bf16_lean")
    for step in (1, 2):
        loop.train(model, optimizer, prec, step - 1, step)
        checkpoint.save(root, model=model, optimizer=optimizer, precision=prec, step=step)
    return model, optimizer, prec


def _data_file(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def _truncate(path: Path) -> Path:
    f = _data_file(path)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f


def _flip_bit(path: Path) -> Path:
    f = _data_file(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    return f


def _remove_metadata(path: Path) -> Path:
    f = path / ".metadata"
    f.unlink()
    return f


def _flip_manifest(path: Path) -> Path:
    f = path / "manifest.json"
    f.write_text(f.read_text().replace('"step": 2', '"step": 3'))
    return f


def _truncate_manifest(path: Path) -> Path:
    f = path / "manifest.json"
    f.write_text(f.read_text()[:100])
    return f


def _remove_manifest(path: Path) -> Path:
    f = path / "manifest.json"
    f.unlink()
    return f


DAMAGE = {
    "truncated": (_truncate, "truncated"),
    "bit flip": (_flip_bit, "corrupt"),
    "missing file": (_remove_metadata, "missing"),
    "altered manifest": (_flip_manifest, "corrupt"),
    "truncated manifest": (_truncate_manifest, "not valid JSON"),
    "missing manifest": (_remove_manifest, "missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_is_refused_naming_the_file_and_latest_valid_falls_back(
    tmp_path: Path, damage: str
) -> None:
    model, optimizer, prec = _two_checkpoints(tmp_path)
    before = loop.snapshot(model, optimizer)
    harm, reason = DAMAGE[damage]
    damaged = harm(tmp_path / "step_00000002")
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)
    message = str(info.value)
    assert "\n" not in message
    assert str(damaged) in message and reason in message and "latest-valid" in message
    after = loop.snapshot(model, optimizer)
    assert all(torch.equal(loop.bits(v), loop.bits(after[k])) for k, v in before.items())

    with pytest.warns(CheckpointWarning, match="skipped a checkpoint"):
        got = checkpoint.load(
            tmp_path, model=model, optimizer=optimizer, precision=prec, resume="latest-valid"
        )
    assert got["step"] == 1


def test_no_valid_checkpoint_at_all(tmp_path: Path) -> None:
    model, optimizer, prec = _two_checkpoints(tmp_path)
    for step in (1, 2):
        _flip_bit(tmp_path / f"step_{step:08d}")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        checkpoint.load(
            tmp_path, model=model, optimizer=optimizer, precision=prec, resume="latest-valid"
        )
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        checkpoint.load(tmp_path / "empty", model=model, optimizer=None, precision=None)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_metadata_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """An adversary who also rewrites the manifest's checksums still runs nothing."""
    model, optimizer, prec = _two_checkpoints(tmp_path)
    path = tmp_path / "step_00000002"
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "bytes": (path / ".metadata").stat().st_size,
        "sha256": file_digest(path / ".metadata"),
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"refusing to load posix\.system|not DCP metadata"):
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)
    assert not marker.exists()


def test_state_that_needs_pickling_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, optimizer, prec = loop.build("bf16_master")
    with pytest.raises(
        CheckpointError, match=r"extra/sched/fn: a builtin_function_or_method cannot be stored"
    ):
        checkpoint.save(
            tmp_path,
            model=model,
            optimizer=optimizer,
            precision=prec,
            step=0,
            extra={"sched": {"fn": len}},
        )
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": -1}, "step must be a whole number >= 0, got -1"),
        ({"step": 1.5}, "step must be a whole number"),
        ({"step": 1, "keep_last": 0}, "keep_last must be a whole number >= 1"),
    ],
)
def test_bad_save_arguments(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    model, optimizer, prec = loop.build("fp32")
    with pytest.raises(CheckpointError, match=match):
        checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=prec, **kwargs)


def test_a_different_model_or_optimizer_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    model, _, prec = _two_checkpoints(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(16, 8))
    with pytest.raises(CheckpointError, match="model differs"):
        checkpoint.load(tmp_path, model=other, optimizer=None, precision=None)
    split = prec.optimizer(
        [{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}]
    )
    with pytest.raises(CheckpointError, match="1 param groups, this one 2"):
        checkpoint.load(tmp_path, model=model, optimizer=split, precision=prec)


def test_extra_round_trips_and_keep_last_prunes(tmp_path: Path) -> None:
    model, optimizer, prec = loop.build("amp_fp16")
    extra = {
        "data": {"seed": 3, "step": 5},
        "sched": {"last_epoch": 5, "base_lrs": [0.1, 0.2], "ids": {1: 2.5}, "pair": (1, "a")},
        "tensor": torch.arange(4, dtype=torch.int16),
        "nan": float("nan"),
    }
    for step in range(4):
        checkpoint.save(
            tmp_path,
            model=model,
            optimizer=optimizer,
            precision=prec,
            step=step,
            extra=extra,
            keep_last=2,
        )
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step_00000002",
        "step_00000003",
    ]
    got = checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)["extra"]
    assert got["data"] == extra["data"] and got["sched"] == extra["sched"]
    assert torch.equal(got["tensor"], extra["tensor"]) and got["tensor"].dtype == torch.int16
    assert got["nan"] != got["nan"]


def test_rng_states_are_restored(tmp_path: Path) -> None:
    import random

    import numpy as np

    model, optimizer, prec = loop.build("fp32")
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=prec, step=0)
    draws = (torch.rand(3), random.random(), np.random.rand())
    loop.seed_everything(123)
    checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]


@pytest.mark.parametrize("name", ["../outside", "/etc/hostname", "..", "sub/file"])
def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(
    tmp_path: Path, name: str
) -> None:
    _two_checkpoints(tmp_path)
    path = tmp_path / "step_00000002"
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a file of this checkpoint"):
        checkpoint.verify(path)


def test_extra_keys_whose_paths_collide_come_back_as_saved(tmp_path: Path) -> None:
    """Found by review: tensors at "loss/train" and at ["loss"]["train"] came back swapped."""
    model, optimizer, prec = loop.build("fp32")
    t0, t1, t2, t3 = (torch.full((2,), float(i)) for i in range(4))
    extra = {"loss/train": t0, "loss": {"train": t1}, 0: t2, "0": t3}
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=prec, step=0, extra=extra)
    got = checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)["extra"]
    assert torch.equal(got["loss/train"], t0) and torch.equal(got["loss"]["train"], t1)
    assert torch.equal(got[0], t2) and torch.equal(got["0"], t3)


def test_a_save_leaves_the_users_own_dot_directories_alone(tmp_path: Path) -> None:
    (tmp_path / ".tmp-cache").mkdir(parents=True)
    (tmp_path / ".trash-bin").mkdir()
    model, optimizer, prec = loop.build("fp32")
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=prec, step=0)
    assert (tmp_path / ".tmp-cache").is_dir() and (tmp_path / ".trash-bin").is_dir()


def test_a_state_that_fails_late_changes_nothing(tmp_path: Path) -> None:
    """Found by review: the model and the Precision were loaded before the optimizer
    state was refused."""
    _two_checkpoints(tmp_path)
    other_model, _, other_prec = loop.build("bf16_lean")
    other_opt = mixprec.optim.AdamW(other_model.parameters(), master="remainder8", moments="bf16")
    before = loop.snapshot(other_model, other_opt)
    steps_before = other_prec.stats.to_dict()
    with pytest.raises(CheckpointError, match="optimizer state"):
        checkpoint.load(tmp_path, model=other_model, optimizer=other_opt, precision=other_prec)
    after = loop.snapshot(other_model, other_opt)
    assert all(torch.equal(loop.bits(v), loop.bits(after[k])) for k, v in before.items())
    assert other_prec.stats.to_dict() == steps_before


def test_a_model_in_other_dtypes_is_refused(tmp_path: Path) -> None:
    model, optimizer, prec = _two_checkpoints(tmp_path)
    model.float()
    with pytest.raises(CheckpointError, match=r"saved torch.bfloat16, here torch.float32"):
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)


def test_hand_edited_pointers_and_steps_are_refused_in_one_line(tmp_path: Path) -> None:
    model, optimizer, prec = _two_checkpoints(tmp_path)
    (tmp_path / "latest").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec)
    with pytest.raises(CheckpointError, match="resume step must be >= 0, got -1"):
        checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=prec, resume=-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot create"):
        checkpoint.save(
            tmp_path / "file" / "ck", model=model, optimizer=optimizer, precision=prec, step=1
        )
