"""The contract's training overrides, and folders written by earlier versions.

`fixtures/v3_overrides` is a `mixprec compare` folder (contract.json and its run
records) written before contracts composed `TrainSettings`, with every training
key overridden (warmup_steps 9 > steps 7 is clamped to 7 in the stored settings).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mixprec.experiment import Contract, rerender, run_experiment, settings_for
from mixprec.experiment.plan import settings_dict
from mixprec.workloads import load_workload

V3_FOLDER = Path(__file__).parent / "fixtures" / "v3_overrides"

#: The training keys a version-3 contract always holds (null: not overridden).
V3_TRAIN_KEYS = [
    "steps",
    "batch_size",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "grad_clip_norm",
]


def _stored() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((V3_FOLDER / "contract.json").read_text(encoding="utf-8"))
    return data


def test_a_version_3_contract_loads_and_writes_back_unchanged() -> None:
    stored = _stored()
    contract = Contract.from_dict(stored["contract"])
    assert contract.train == {
        "steps": 7,
        "batch_size": 16,
        "lr": 0.005,
        "min_lr": 0.0001,
        "warmup_steps": 9,
        "weight_decay": 0.05,
        "grad_clip_norm": 2.0,
    }
    # Same keys, same order, same values: the file it writes is the file it read.
    assert json.dumps(contract.to_dict(), indent=1) == json.dumps(stored["contract"], indent=1)
    settings = settings_for(contract, load_workload("digits", size="tiny"))
    assert settings_dict(settings) == stored["settings"]


def test_version_3_run_records_keep_their_fingerprints() -> None:
    contract = Contract.from_dict(_stored()["contract"])
    records = sorted((V3_FOLDER / "runs").glob("*.json"))
    assert [p.name for p in records] == ["amp_bf16-seed0.json", "fp32-seed0.json"]
    for path in records:
        record = json.loads(path.read_text(encoding="utf-8"))
        expected = contract.run_fingerprint(record["policy"], record["seed"], record["steps"])
        assert record["fingerprint"] == expected, path.name


def test_a_version_3_folder_is_reused_and_rerendered(tmp_path: Path) -> None:
    folder = tmp_path / "v3"
    shutil.copytree(V3_FOLDER, folder)
    again = rerender(folder)
    assert [(r.policy, r.seed) for r in again.records] == [("amp_bf16", 0), ("fp32", 0)]
    assert not [n for n in again.notes if "ignored" in n or "missing" in n], again.notes
    reused: list[bool] = []
    run_experiment(again.contract, folder, stream=None, on_record=lambda r, was: reused.append(was))
    assert reused == [True, True]  # nothing retrained


def test_overrides_added_since_version_3_are_written_only_when_set() -> None:
    plain = Contract()
    assert [k for k in plain.to_dict() if k in V3_TRAIN_KEYS] == V3_TRAIN_KEYS
    assert all(plain.to_dict()[k] is None for k in V3_TRAIN_KEYS)
    assert "betas" not in plain.to_dict()
    betas = Contract.from_dict({"betas": [0.9, 0.95]})
    assert betas.train == {"betas": (0.9, 0.95)} and betas.to_dict()["betas"] == [0.9, 0.95]
    assert Contract.from_dict(betas.to_dict()) == betas
    assert betas.run_fingerprint("amp_bf16", 0) != plain.run_fingerprint("amp_bf16", 0)


def test_train_overrides_are_checked_by_train_settings() -> None:
    assert Contract(train={"lr": 1, "steps": None}).train == {"lr": 1.0}
    with pytest.raises(ValueError, match=r"unknown training setting\(s\) 'stepz'; valid: steps"):
        Contract(train={"stepz": 3})
    with pytest.raises(ValueError, match=r"min_lr \(0.01\) must not exceed lr \(0.001\)"):
        Contract(train={"lr": 1e-3, "min_lr": 1e-2})
    with pytest.raises(ValueError, match="training overrides must be a mapping"):
        Contract(train=3)  # type: ignore[arg-type]
    # The dict form keeps training keys at the top level, as it always had.
    with pytest.raises(ValueError, match=r"unknown contract keys \['train'\]"):
        Contract.from_dict({"train": {"steps": 3}})
    assert Contract.from_dict({"steps": 3.0, "lr": "1e-3"}).train == {"steps": 3, "lr": 1e-3}
