"""The measurement cache: where it lives, hits, misses, corrupt entries ignored, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixprec.speed import cache_mode, speed_cache_dir
from mixprec.speed.cache import SCHEMA, entry_path, read_entry, write_entry

KEY = {
    "device": {"name": "test cpu"},
    "torch": "2.13",
    "threads": 2,
    "target": "m:1x2x3",
    "formats": ["fp32", "bf16"],
    "repeats": 2,
}
SAMPLES = {"fp32": (1.0, 1.5), "bf16": (2.0, 2.5)}


def test_speed_entries_live_in_the_user_cache_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "m"))
    assert speed_cache_dir() == tmp_path / "m" / "speed"
    assert speed_cache_dir(tmp_path / "x") == tmp_path / "x"


def test_mode_from_argument_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_mode() == "use"
    monkeypatch.setenv("MIXPREC_SPEED_CACHE", "off")
    assert cache_mode() == "off"
    assert cache_mode("refresh") == "refresh", "an argument wins"
    monkeypatch.setenv("MIXPREC_SPEED_CACHE", "sometimes")
    with pytest.raises(
        ValueError,
        match="MIXPREC_SPEED_CACHE='sometimes' is not a cache mode; valid: use, refresh, off",
    ):
        cache_mode()
    with pytest.raises(ValueError, match="cache='never'"):
        cache_mode("never")


def test_write_then_read_is_a_hit_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    assert read_entry(KEY, tmp_path) == ("miss", None)
    path = write_entry(KEY, SAMPLES, tmp_path)
    assert path == entry_path(KEY, tmp_path) and path.parent == tmp_path
    assert read_entry(KEY, tmp_path) == ("hit", SAMPLES)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert read_entry({**KEY, "threads": 1}, tmp_path) == ("miss", None), (
        "another key, another file"
    )


def _entry(**changes: object) -> str:
    data: dict[str, object] = {
        "schema": SCHEMA,
        "key": KEY,
        "samples": {"fp32": [1.0, 1.5], "bf16": [2.0, 2.5]},
    }
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{not json",
        "[]",
        _entry(schema=SCHEMA + 1),
        _entry(key={**KEY, "threads": 8}),  # a digest collision or a hand-edited file
        _entry(samples={"bf16": [2.0]}),  # no fp32
        _entry(samples={"fp32": [1.0, 1.5], "fp8": [0.5, 0.5]}),
        # edited by hand: a format the key did not measure, one it did left out, a sample
        # more or fewer than its repeats (auto would pick from them)
        _entry(samples={"fp32": [1.0, 1.5], "bf16": [2.0, 2.5], "fp16": [1e-3, 1e-3]}),
        _entry(samples={"fp32": [1.0, 1.5]}),
        _entry(samples={"fp32": [1.0, 1.5], "bf16": [2.0]}),
        _entry(samples={"fp32": [1.0, 1.5, 1.6], "bf16": [2.0, 2.5, 2.6]}),
        _entry(samples={"fp32": [-1.0]}),
        _entry(samples={"fp32": [True]}),
        _entry(samples={"fp32": []}),
        _entry(samples={"fp32": "1.0"}),
        _entry(samples=None),
    ],
)
def test_a_corrupt_entry_is_ignored_not_fatal(text: str, tmp_path: Path) -> None:
    path = entry_path(KEY, tmp_path)
    tmp_path.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    assert read_entry(KEY, tmp_path) == ("corrupt", None)
    assert write_entry(KEY, SAMPLES, tmp_path) == path, "and replaced by the next write"
    assert read_entry(KEY, tmp_path) == ("hit", SAMPLES)


def test_unreadable_entries_are_corrupt(tmp_path: Path) -> None:
    path = entry_path(KEY, tmp_path)
    path.mkdir(parents=True)  # a folder where the file should be
    assert read_entry(KEY, tmp_path) == ("corrupt", None)
    path.rmdir()
    path.write_bytes(b"\xff\xfe\x00")
    assert read_entry(KEY, tmp_path) == ("corrupt", None)


def test_an_unwritable_folder_is_not_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert write_entry(KEY, SAMPLES, blocker / "speed") is None
    assert blocker.read_text() == "x"
