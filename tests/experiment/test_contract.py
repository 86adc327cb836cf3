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
from mixprec.experiment.contract import DECISION_KEYS, parse_bytes
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
    # In the order compare runs them: by seed, the baseline first.
    assert [(r.policy, r.seed) for r in again.records] == [("fp32", 0), ("amp_bf16", 0)]
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


# ------------------------------------------------- objective, budgets, target


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6 GiB", 6 * 2**30),
        ("512MiB", 512 * 2**20),
        (" 1.5 kib ", 1536),
        ("8 GB", 8 * 10**9),
        ("2kB", 2000),
        ("4096", 4096),
        (4096, 4096),
        (6.5e9, 6_500_000_000),
        ("1e3", 1000),
    ],
)
def test_memory_budgets_read_bytes_or_a_size_with_a_unit(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert Contract(memory_budget=text).memory_budget == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["6 G", "6 GiBs", "", "lots", 0, -1, True, float("nan"), None])
def test_a_bad_memory_budget_names_the_value_and_the_forms(bad: object) -> None:
    with pytest.raises(ValueError, match=r"memory_budget .* is not a size: give bytes .* 6 GiB"):
        parse_bytes(bad)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"objective": "fast"}, r"objective 'fast' is not one of balanced, memory, speed"),
        ({"objective": None}, r"objective None is not one of"),
        ({"max_slowdown": 0}, r"max_slowdown 0 is not a number > 0: .* e\.g\. 1\.5"),
        ({"max_slowdown": "slow"}, r"max_slowdown 'slow' is not a number > 0"),
        ({"max_slowdown": float("inf")}, r"max_slowdown inf is not a number > 0"),
        ({"target_device": " "}, r"target_device ' ' is empty: give a device class"),
        ({"target_device": "--"}, r"target_device '--' is empty: give a device class"),
        ({"target_device": "cpu:abc"}, r"target_device 'cpu:abc': a device index is a number"),
        ({"target_device": "H100" * 60}, r"target_device is 240 characters long"),
        ({"memory_budget": "6 G"}, r"memory_budget '6 G' is not a size"),
    ],
)
def test_decision_keys_are_checked(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Contract(**kw)
    with pytest.raises(ValueError, match=message):
        Contract.from_dict(kw)


def test_decision_keys_read_from_files_and_write_back() -> None:
    data = {
        "objective": "speed",
        "memory_budget": "6 GiB",
        "max_slowdown": "1.5",
        "target_device": "cuda",
    }
    c = Contract.from_dict(data)
    assert (c.objective, c.memory_budget, c.max_slowdown, c.target_device) == (
        "speed",
        6 * 2**30,
        1.5,
        "cuda",
    )
    stored = c.to_dict()
    assert stored["memory_budget"] == 6 * 2**30 and Contract.from_dict(stored) == c
    # Left at their defaults, they are not written (files of earlier versions stay as read).
    assert not set(DECISION_KEYS) & set(Contract().to_dict())
    assert Contract(objective="balanced").to_dict() == Contract().to_dict()


@pytest.mark.parametrize(
    "kw",
    [
        {"objective": "memory"},
        {"objective": "speed"},
        {"memory_budget": "6 GiB"},
        {"max_slowdown": 1.2},
        {"target_device": "H100"},
    ],
)
def test_decision_keys_change_the_digest_but_no_run_fingerprint(kw: dict[str, Any]) -> None:
    """They change what is judged, not what a run computes: stored runs are re-judged
    under them without training again."""
    plain, judged = Contract(), Contract(**kw)
    assert judged.digest() != plain.digest()
    for policy in ("fp32", "amp_bf16"):
        assert judged.run_fingerprint(policy, 0, 500) == plain.run_fingerprint(policy, 0, 500)
    assert Contract(**kw).digest() == judged.digest()


@pytest.mark.parametrize("value", [1.5, "1.5", "2.5 B"])
def test_a_fractional_byte_budget_asks_for_its_unit(value: object) -> None:
    """Found by review: --memory-budget 1.5 was rounded to 2 bytes, silently."""
    with pytest.raises(ValueError, match=r"fraction of a byte count: add the unit"):
        parse_bytes(value)
    assert parse_bytes("1.5 GiB") == 3 * 2**29


@pytest.mark.parametrize("value", [123, ["cuda"], True])
def test_a_target_device_of_the_wrong_type_is_not_called_empty(value: object) -> None:
    """Found by review: target_device: 123 was refused as 'is empty'."""
    with pytest.raises(ValueError, match=r"is not a device: give a device class"):
        Contract(target_device=value)  # type: ignore[arg-type]


def test_released_gradients_enter_a_run_fingerprint_only_when_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mixprec.experiment.contract as contract_module
    from mixprec.policy import preset

    contract = Contract()
    plain = contract.run_fingerprint("bf16_lean", 0)
    for release, same in ((False, True), (True, False)):
        monkeypatch.setattr(
            contract_module,
            "preset",
            lambda name, release=release: preset(name).replace(
                name=name, release_gradients=release
            ),
        )
        assert (contract.run_fingerprint("bf16_lean", 0) == plain) is same
