"""The order of runs, resuming and the output folder, with a scripted run function.

`run_all` takes the function that trains one run, so nothing trains here.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.experiment import Contract, RunRecord
from mixprec.experiment.hardware import DeviceFacts
from mixprec.experiment.orchestration import CONTRACT_FILE, run_all
from mixprec.experiment.plan import RunSettings, settings_dict
from mixprec.experiment.summary import tail_start
from mixprec.workloads import DIGITS_SIZES, load_workload

CONTRACT = Contract(
    workload="digits",
    size="tiny",
    candidates=("amp_bf16", "bf16_master"),
    seeds=2,
    max_seeds=2,
    train={"steps": 10},
    step_caps={"bf16_master": 4},
)
SETTINGS = RunSettings(
    train=DIGITS_SIZES["tiny"].train.with_overrides(CONTRACT.train),
    eval_every=CONTRACT.eval_every,
    probe_every=CONTRACT.probe_every,
)


HERE = DeviceFacts(
    device_type="cpu", name="Some CPU", flags=("avx512_bf16",), torch="2.13", threads=2
)


def _scripted(
    calls: list[tuple[str, int, int | None]], device: DeviceFacts | None = HERE
) -> Callable[..., RunRecord]:
    def run(workload: Any, name: str, seed: int, settings: RunSettings, **kw: Any) -> RunRecord:
        assert settings is SETTINGS and kw["device"] == "cpu"
        calls.append((name, seed, kw["run_steps"]))
        steps = kw["run_steps"]
        return RunRecord(
            workload=workload.name,
            size="tiny",
            policy=name,
            policy_fields={},
            seed=seed,
            steps=steps,
            schedule_steps=settings.train.steps,
            fingerprint=kw["fingerprint"],
            final_train_loss=1.0,
            heldout_loss=1.0,
            metric=1.0,
            metric_name="macro_f1",
            # Evaluated where the plan asks, as the runner does (eval_at).
            eval_curve=[
                [s, 2.0 if s == 0 else 1.0]
                for s in sorted({0, tail_start(steps), steps, *kw["eval_at"]})
                if s <= steps
            ],
            bytes={"total": 100},
            throughput={"steps_per_s": 1.0},
            device=device,
        )

    return run


def test_runs_go_in_order_write_the_folder_and_resume(tmp_path: Path) -> None:
    workload = load_workload("digits", size="tiny")
    calls: list[tuple[str, int, int | None]] = []
    kw: dict[str, Any] = dict(
        device="cpu", stream=None, on_record=None, should_stop=None, hardware=HERE
    )
    records = run_all(CONTRACT, tmp_path, workload, SETTINGS, run=_scripted(calls), **kw)
    assert calls == [
        ("fp32", 0, 10),
        ("amp_bf16", 0, 10),
        ("bf16_master", 0, 4),  # capped: stops at its cap, schedule of 10 steps
        ("fp32", 1, 10),
        ("amp_bf16", 1, 10),
        ("bf16_master", 1, 4),
    ]
    assert [(r.policy, r.seed) for r in records] == [(n, s) for n, s, _ in calls]
    stored = json.loads((tmp_path / CONTRACT_FILE).read_text())
    assert stored["contract"] == CONTRACT.to_dict()
    assert stored["settings"] == settings_dict(SETTINGS)
    assert len(list((tmp_path / "runs").glob("*.json"))) == 6
    # Every record is on disk with its fingerprint: a rerun trains nothing.
    again: list[tuple[str, int, int | None]] = []
    reused: list[bool] = []
    kw["on_record"] = lambda r, was: reused.append(was)
    rerun = run_all(CONTRACT, tmp_path, workload, SETTINGS, run=_scripted(again), **kw)
    assert again == [] and reused == [True] * 6
    assert [r.to_dict() for r in rerun] == [r.to_dict() for r in records]


def test_a_stored_run_is_reused_only_on_the_hardware_it_was_measured_on(tmp_path: Path) -> None:
    workload = load_workload("digits", size="tiny")
    kw: dict[str, Any] = dict(device="cpu", stream=None, on_record=None, should_stop=None)
    run_all(CONTRACT, tmp_path, workload, SETTINGS, run=_scripted([]), hardware=HERE, **kw)
    stored = json.loads((tmp_path / "runs" / "fp32-seed0.json").read_text())
    assert DeviceFacts.from_dict(stored["device"]) == HERE
    # Other threads (or torch, or device): timings are not comparable, every run is redone.
    other = DeviceFacts(**{**HERE.to_dict(), "flags": HERE.flags, "threads": 8})
    calls: list[tuple[str, int, int | None]] = []
    records = run_all(
        CONTRACT, tmp_path, workload, SETTINGS, run=_scripted(calls, other), hardware=other, **kw
    )
    assert len(calls) == 6 and all(r.device == other for r in records)
    # Records written before hardware was recorded carry none: reused as they are.
    bare = tmp_path / "bare"
    bare.mkdir()
    run_all(CONTRACT, bare, workload, SETTINGS, run=_scripted([], None), hardware=HERE, **kw)
    again: list[tuple[str, int, int | None]] = []
    run_all(CONTRACT, bare, workload, SETTINGS, run=_scripted(again), hardware=HERE, **kw)
    assert again == []
    # ... unless the contract names a target: then where they ran decides, so they rerun
    # (a reused record "measured on hardware not recorded" kept the decision pending).
    targeted = dataclasses.replace(CONTRACT, target_device="cpu")
    run_all(targeted, bare, workload, SETTINGS, run=_scripted(again), hardware=HERE, **kw)
    assert len(again) == 6
    once_more: list[tuple[str, int, int | None]] = []
    run_all(targeted, bare, workload, SETTINGS, run=_scripted(once_more), hardware=HERE, **kw)
    assert once_more == [], "the rerun records say where they ran: reused from now on"


def _stepping(calls: list[tuple[str, int, int | None]]) -> Callable[..., RunRecord]:
    """`_scripted`, reporting every step to the progress callback as a run does."""
    scripted = _scripted(calls)

    def run(workload: Any, name: str, seed: int, settings: RunSettings, **kw: Any) -> RunRecord:
        for step in range(1, kw["run_steps"] + 1):
            kw["progress"](step, 1.0)
        record = scripted(workload, name, seed, settings, **kw)
        return dataclasses.replace(record, wall_time_s=2.5)

    return run


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_that_is_not_a_terminal_gets_one_line_per_run_and_no_bars(tmp_path: Path) -> None:
    # Issue 31: `make demo > log` wrote 75 KB of progress bars (carriage returns).
    workload = load_workload("digits", size="tiny")
    log = io.StringIO()
    kw: dict[str, Any] = dict(device="cpu", on_record=None, should_stop=None, hardware=HERE)
    run_all(CONTRACT, tmp_path, workload, SETTINGS, run=_stepping([]), stream=log, **kw)
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 6, text
    ran = [(n, s, 4 if n == "bf16_master" else 10) for s in (0, 1) for n in CONTRACT.policies]
    for line, (name, seed, steps) in zip(lines, ran, strict=True):
        assert line.split() == [
            name, "seed", str(seed), f"{steps}", "steps", "2.5s", "1.0", "steps/s",
            "held-out", "loss", "1.0000", "macro_f1", "1.0000", "skipped", "0",
        ], line  # fmt: skip
    # A rerun reuses every record and says so, one line each.
    log = io.StringIO()
    run_all(CONTRACT, tmp_path, workload, SETTINGS, run=_stepping([]), stream=log, **kw)
    assert [line.endswith("(reused)") for line in log.getvalue().splitlines()] == [True] * 6


def test_a_terminal_gets_a_bar_per_run_and_the_same_lines(tmp_path: Path) -> None:
    workload = load_workload("digits", size="tiny")
    log = _Terminal()
    kw: dict[str, Any] = dict(device="cpu", on_record=None, should_stop=None, hardware=HERE)
    run_all(CONTRACT, tmp_path, workload, SETTINGS, run=_stepping([]), stream=log, **kw)
    text = log.getvalue()
    assert "fp32 seed 0:" in text and "\r" in text  # tqdm's bar, cleared after each run
    finished = [line for line in text.split("\n") if "held-out loss" in line]
    assert len(finished) == 6
