from __future__ import annotations

import dataclasses
import importlib
import json
import math
from pathlib import Path

import pytest

from mixprec.cli import main
from mixprec.experiment import Contract, read_records, run_experiment

RUN_KEYS = {
    "policy",
    "seed",
    "final_train_loss",
    "heldout_loss",
    "metric",
    "nonfinite_steps",
    "skipped_steps",
    "bytes",
    "doctor",
    "policy_fields",
    "loss_scale_trace",
    "throughput",
    "wall_time_s",
    "frozen_fraction",
}


def test_runner_trains_every_preset_with_full_records(
    every_preset: tuple[Path, Contract, list],
) -> None:  # type: ignore[type-arg]
    _out, contract, records = every_preset
    assert [r.policy for r in records] == list(contract.policies)
    for r in records:
        assert r.ok, (r.policy, r.error)
        assert math.isfinite(r.heldout_loss) and 0.0 <= r.metric <= 1.0
        d = r.to_dict()
        assert set(d) >= RUN_KEYS
        for key in (
            "compute_dtype",
            "param_dtype",
            "master",
            "moments",
            "reduce_dtype",
            "loss_scaling",
        ):
            assert key in d["policy_fields"]
        for comp in ("params", "grads", "master", "moments", "activations", "total"):
            assert comp in r.bytes
        # Predicted and measured agree exactly for the state, closely for activations.
        for comp in ("params", "fp32_islands", "grads", "master", "moments"):
            assert r.bytes[comp] == r.predicted_bytes[comp], (r.policy, comp)
        assert r.predicted_bytes["activations"] == pytest.approx(r.bytes["activations"], rel=0.15)
        # Step 0, every 2 steps (eval_every 6 would leave too few points on 12 steps for a
        # curve), the start of the last fifth (for the length check), the end.
        assert [int(step) for step, _ in r.eval_curve] == [0, 2, 4, 6, 8, 9, 10, 12]
    by = {r.policy: r for r in records}
    assert by["amp_fp16"].loss_scale_trace and not by["fp32"].loss_scale_trace
    assert by["bf16_master"].bytes["master"] > 0 and by["fp32"].bytes["master"] == 0
    # bf16 storage halves the non-island parameter bytes.
    bf16 = by["bf16_pure"].bytes
    assert bf16["params"] * 2 + bf16["fp32_islands"] == by["fp32"].bytes["params"]
    assert "optimizer-state-16bit" in by["bf16_pure"].doctor_rules


def test_resume_skips_finished_runs(
    every_preset: tuple[Path, Contract, list], tmp_path: Path
) -> None:  # type: ignore[type-arg]
    out, contract, records = every_preset
    reused: list[bool] = []
    _, again = run_experiment(
        contract, out, stream=None, on_record=lambda r, was: reused.append(was)
    )
    assert all(reused) and len(reused) == len(records)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in records]
    # A changed setting changes the fingerprint: that run is redone.
    reused.clear()
    run_experiment(
        Contract(
            workload="digits",
            size="tiny",
            baseline="fp32",
            candidates=("amp_bf16",),
            seeds=1,
            max_seeds=1,
            train={"steps": 13},
        ),
        out,
        stream=None,
        on_record=lambda r, was: reused.append(was),
    )
    assert reused == [False, False]


def test_cli_compare_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c"
    code = main(
        [
            "compare",
            "--workload",
            "digits",
            "--size",
            "tiny",
            "--policies",
            "fp32,amp_bf16",
            "--steps",
            "8",
            "--seeds",
            "1",
            "--max-seeds",
            "1",
            "--out",
            str(out),
            "--quiet",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    assert data["baseline"] == "fp32" and [r["policy"] for r in data["runs"]] == [
        "fp32",
        "amp_bf16",
    ]
    assert main(["report", str(out), "--json"]) == code
    assert json.loads(capsys.readouterr().out)["decision"] == data["decision"]
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["compare", "--policies", "nope", "--out", str(out), "--quiet"]) == 2


def test_contract_file_cannot_import_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workload: os:system\nsteps: 3\n")
    assert main(["compare", "--config", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "module:function would run code" in capsys.readouterr().err
    cfg.write_text("workload: [unclosed\n")
    assert main(["compare", "--config", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2


def test_read_records_names_a_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"x\.json: not valid JSON"):
        read_records(tmp_path)


def test_fp16_runs_are_capped_where_fp16_is_emulated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from mixprec.device import DeviceCaps
    from mixprec.experiment.runner import step_caps_for

    def caps(fast: bool) -> DeviceCaps:
        return DeviceCaps(
            device_type="cpu",
            name="cpu",
            bf16_supported=True,
            fp16_supported=True,
            bf16_fast=False,
            fp16_fast=fast,
            bf16_reason="",
            fp16_reason="",
        )

    plan = importlib.import_module("mixprec.experiment.plan")
    contract = Contract(
        workload="digits",
        size="tiny",
        candidates=("amp_bf16", "amp_fp16"),
        seeds=1,
        max_seeds=1,
        train={"steps": 10},
    )
    monkeypatch.setattr(plan, "device_caps", lambda device=None: caps(True))
    assert step_caps_for(contract, 10, "cpu") == {}
    monkeypatch.setattr(plan, "device_caps", lambda device=None: caps(False))
    assert step_caps_for(contract, 10, "cpu") == {"amp_fp16": 2}
    explicit = dataclasses.replace(contract, step_caps={"amp_fp16": 50})
    assert step_caps_for(explicit, 10, "cpu") == {"amp_fp16": 10}
    _, records = run_experiment(contract, tmp_path, stream=None)
    by = {r.policy: r for r in records}
    assert by["amp_fp16"].steps == 2 and by["amp_fp16"].schedule_steps == 10
    assert by["fp32"].steps == 10 and [2, by["fp32"].heldout_at(2)] in by["fp32"].eval_curve
    assert math.isfinite(by["fp32"].heldout_at(2))
    # The training-length check reads the baseline at the start of each last fifth.
    assert math.isfinite(by["fp32"].heldout_at(8)) and math.isfinite(by["fp32"].heldout_at(1))


def test_runs_with_dropout_repeat_and_pair_and_leave_the_callers_stream() -> None:
    """Reported: compare did not seed torch's global generator, so a workload with
    dropout gave another held-out loss each time the same command ran, and the policies
    of one seed saw other dropout masks. Each step's draws come from (seed, step)."""
    import torch
    from tests.workloads.example_user_workload import make_workload

    from mixprec.experiment.plan import RunSettings
    from mixprec.experiment.runner import run_one

    workload = make_workload(dropout=0.5)
    train = dataclasses.replace(workload.defaults, steps=6)
    settings = RunSettings(train=train, eval_every=3, probe_every=100)

    def losses(policy: str, seed: int) -> list[float]:
        return [loss for _, loss in run_one(workload, policy, seed, settings).loss_curve]

    torch.manual_seed(123)
    caller = torch.get_rng_state()
    first = losses("fp32", 0)
    assert torch.equal(torch.get_rng_state(), caller)  # the caller's stream is left alone
    torch.rand(7)  # the caller's own draws change nothing
    assert losses("fp32", 0) == first
    assert losses("fp32", 1) != first


def test_every_policy_of_a_seed_draws_the_same_dropout_masks() -> None:
    """Pairing: a step's dropout masks depend on (seed, step) alone, not on the policy."""
    import torch
    from tests.workloads.example_user_workload import make_workload

    from mixprec import Precision
    from mixprec.experiment.runner import model_seed, training_step

    workload = make_workload(dropout=0.5)
    masks: dict[str, list[torch.Tensor]] = {}
    for policy in ("fp32", "amp_bf16", "bf16_master"):
        prec = Precision(policy)
        model = prec.prepare(workload.make_model(0))
        optimizer = prec.optimizer(model, lr=1e-2)
        seen = masks.setdefault(policy, [])
        model[0].register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out == 0))
        for step in range(3):
            x, y = workload.train_batch(step=step, seed=0, batch_size=16, device="cpu")
            training_step(
                workload,
                prec,
                model,
                optimizer,
                x,
                y,
                workload.defaults,
                rng_seed=model_seed(0, step),
            )
    assert all(m.any() for m in masks["fp32"])  # dropout dropped something
    # The model's dropout sees fp32 inputs under every policy here; on this device it
    # also draws the same masks on 16-bit tensors (docs/compare.md).
    drawn = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(model_seed(0, 0))
        drawn.append(torch.nn.functional.dropout(torch.ones(4096, dtype=dtype), 0.5) == 0)
    assert all(torch.equal(drawn[0], d) for d in drawn[1:])
    for policy in ("amp_bf16", "bf16_master"):
        assert all(torch.equal(a, b) for a, b in zip(masks["fp32"], masks[policy], strict=True))
