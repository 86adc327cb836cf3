"""`mixprec compare` and `mixprec report` with objectives, budgets and a target device.

The runs are scripted (the runner's `run_one` replaced), so nothing trains: the
figures below are the demo's shape of issue 18 (fp32 fastest and largest, the
bf16-storage policies half its memory at about half its speed).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from mixprec.cli import main
from mixprec.experiment import RunRecord
from mixprec.experiment.hardware import device_facts
from mixprec.experiment.summary import tail_start

#: policy: (bytes, steps/s, relative held-out gap); fp32 stores 8 MiB.
FIGURES = {
    "fp32": (8 * 2**20, 120.0, 0.0),
    "amp_bf16": (7 * 2**20, 80.0, 0.001),
    "bf16_master": (5 * 2**20, 60.0, 0.002),
    "bf16_lean": (4 * 2**20, 50.0, 0.001),
}
POLICIES = "amp_bf16,bf16_master,bf16_lean"


def _scripted_run_one(workload: Any, name: str, seed: int, settings: Any, **kw: Any) -> RunRecord:
    steps = kw["run_steps"]
    total, speed, gap = FIGURES[name]
    loss = (1.0 + seed / 10) * (1 + gap)
    return RunRecord(
        workload=workload.name,
        size="tiny",
        policy=name,
        policy_fields={"param_dtype": "fp32" if name in ("fp32", "amp_bf16") else "bf16"},
        seed=seed,
        steps=steps,
        fingerprint=kw["fingerprint"],
        heldout_loss=loss,
        metric=0.9,
        metric_name="macro_f1",
        eval_curve=[[0, 2 * loss], [tail_start(steps), loss], [steps, loss]],
        bytes={"total": total},
        throughput={"steps_per_s": speed},
        device=device_facts(kw["device"]),
    )


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = importlib.import_module("mixprec.experiment.runner")
    monkeypatch.setattr(runner, "run_one", _scripted_run_one)


def _compare(tmp_path: Path, *flags: str) -> list[str]:
    base = ["compare", "--workload", "digits", "--size", "tiny", "--steps", "10"]
    return [*base, "--policies", POLICIES, "--out", str(tmp_path), "--quiet", *flags]


@pytest.mark.usefixtures("scripted")
def test_speed_stays_on_the_faster_baseline_and_memory_takes_the_smallest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_compare(tmp_path, "--objective", "speed")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"Measured on {device_facts('cpu').describe()}")
    assert out[1].startswith("Recommended: stay on fp32 (objective speed")
    assert out[-1].startswith("recommended: stay on fp32")
    decision = json.loads((tmp_path / "results.json").read_text())["decision"]
    assert decision["status"] == "stay" and decision["recommended"] == "fp32"
    # The same runs, judged again under another objective: nothing trains.
    assert main(_compare(tmp_path, "--objective", "memory")) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("Recommended: bf16_lean (objective memory")
    assert "bf16_lean: memory 0.500 of fp32's (step time 2.400)" in out


@pytest.mark.usefixtures("scripted")
def test_balanced_shows_its_arithmetic_in_every_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_compare(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "bf16_lean: memory 0.500 x step time 2.400 = 1.200" in out
    assert "Chosen: stay on fp32 at 1.000, next bf16_lean at 1.200." in out
    md = (tmp_path / "report.md").read_text()
    assert "- `bf16_lean`: memory 0.500 x step time 2.400 = 1.200" in md
    assert md.splitlines()[2].startswith("Measured on cpu ")
    assert "Workload `digits --size tiny`" in md
    assert "| 50.0% | 2.40x |" in md  # bf16_lean: memory saved, step time (paired)


@pytest.mark.usefixtures("scripted")
def test_a_memory_budget_below_fp32_rejects_fp32_storage_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_compare(tmp_path, "--memory-budget", "6.5 MiB")) == 0
    out = capsys.readouterr().out
    assert (
        "amp_bf16: rejected (memory-budget): measured 7.00 MiB, 512.00 KiB over memory_budget "
        "6.50 MiB (fp32 storage: its parameters, gradients and moments are the baseline's)"
    ) in out
    assert "fp32: baseline: fp32 itself measured 8.00 MiB, 1.50 MiB over memory_budget" in out
    assert out.splitlines()[1].startswith("Recommended: bf16_lean (objective balanced")


@pytest.mark.usefixtures("scripted")
def test_a_cuda_target_measured_on_cpu_is_pending_in_the_first_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_compare(tmp_path, "--target-device", "cuda", "--objective", "speed")) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("Target: cuda, not where these runs were measured.")
    assert out[1].startswith("Pending a run on the target cuda: nothing is promoted.")
    assert out[-1].startswith("recommended: none, pending a run on cuda")
    assert any("bf16_lean" in line and "eligible, pending target" in line for line in out)
    md = (tmp_path / "report.md").read_text().splitlines()
    assert md[4].startswith("Pending a run on the target cuda")
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["decision"]["status"] == "pending_target"
    assert stored["decision"]["recommended"] is None
    # `mixprec report` re-judges the folder the same way.
    assert main(["report", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[1].startswith("Pending a run on the target cuda")
    # Nothing to train from it: `train --policy-from` says why.
    assert main(["train", "--policy-from", str(tmp_path), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "compare recommended no policy (pending a run on the target: measured on cpu" in err


@pytest.mark.usefixtures("scripted")
def test_contract_files_carry_the_decision_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "contract.yaml"
    config.write_text("objective: memory\nmemory_budget: 6 GiB\nmax_slowdown: 3\n")
    assert main([*_compare(tmp_path / "out"), "--config", str(config)]) == 0
    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    contract = stored["contract"]
    assert (contract["objective"], contract["memory_budget"], contract["max_slowdown"]) == (
        "memory",
        6 * 2**30,
        3.0,
    )
    assert stored["decision"]["recommended"] == "bf16_lean"
    # A flag overrides the file.
    assert main([*_compare(tmp_path / "out"), "--config", str(config), "--max-slowdown", "2"]) == 0
    capsys.readouterr()
    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    assert stored["decision"]["policies"]["bf16_lean"]["verdict"]["gate"] == "slowdown"
    assert stored["decision"]["recommended"] == "bf16_master"


@pytest.mark.usefixtures("scripted")
def test_with_no_candidate_within_the_budgets_fp32_stays_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 31: `--max-slowdown 1.2` rejected every candidate and printed "No candidate
    passed the gates", exit 1, where fp32 itself is within the budget."""
    assert main(_compare(tmp_path, "--max-slowdown", "1.2")) == 0
    assert "recommended: stay on fp32" in capsys.readouterr().out
    stored = json.loads((tmp_path / "results.json").read_text())["decision"]
    assert stored["status"] == "stay" and stored["eligible"] == []
    assert {v["verdict"]["gate"] for p, v in stored["policies"].items() if p != "fp32"} == {
        "slowdown"
    }
    # The gap limit is a flag too: a limit under amp_bf16's 0.1% gap rejects it.
    assert main(_compare(tmp_path, "--max-rel-loss-gap", "0.0005")) == 0
    stored = json.loads((tmp_path / "results.json").read_text())["decision"]
    assert stored["policies"]["amp_bf16"]["verdict"]["gate"] == "loss-gap"
    assert stored["policies"]["amp_bf16"]["verdict"]["status"] == "rejected"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--objective", "fast"], "objective 'fast' is not one of balanced, memory, speed"),
        (["--memory-budget", "6 G"], "memory_budget '6 G' is not a size: give bytes"),
        (["--max-slowdown", "0"], "max_slowdown '0' is not a number > 0"),
        (["--target-device", ""], "target_device '' is empty: give a device class"),
        (["--max-rel-loss-gap", "-1"], "max_rel_loss_gap must be a fraction in [0, 1)"),
        (["--max-rel-loss-gap", "5"], "max_rel_loss_gap must be a fraction in [0, 1) (0.005"),
        (["--optimizer", "muon"], "optimizer 'muon' is not one of adamw, adam, sgd, lion"),
        (["--optimizer", "sgd"], "optimizer sgd needs a learning rate"),
        (["--optimizer", "sgd", "--optimizer-args", "lr=0.1,betas=(0.9,0.9)"], "'betas' is not"),
        (["--optimizer-args", "lr=1e-3;eps=1"], "lr='1e-3;eps=1' is not a number"),
        (["--optimizer-args", "master=exact"], "the policy decides the master"),
        (["--optimizer-args", "eps=-1"], "optimizer adamw refuses its arguments (eps=-1)"),
        (["--policies", "bf16_lean4"], "so grad_clip_norm=1.0 cannot apply: set `grad_clip"),
    ],
)
def test_bad_decision_flags_exit_2_with_one_line(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", "--out", str(tmp_path / "o"), "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_bad_decision_keys_in_a_file_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("objective: cheapest\nmemory_budget: 6 GiB\n")
    assert main(["compare", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{config}: objective 'cheapest' is not one of" in err
    # A bad flag over a good file is the flag's, not the file's.
    argv = ["compare", "--config", str(config), "--memory-budget", "6 G"]
    assert main([*argv, "--objective", "memory", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec: error: memory_budget '6 G' is not a size"), err


@pytest.mark.usefixtures("scripted")
def test_an_interrupted_rerun_is_what_report_and_policy_from_see(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(_compare(tmp_path, "--objective", "memory")) == 0
    capsys.readouterr()
    runner = importlib.import_module("mixprec.experiment.runner")
    scripted = runner.run_one

    def interrupted(workload: Any, name: str, seed: int, settings: Any, **kw: Any) -> RunRecord:
        if name == "bf16_kahan":
            raise KeyboardInterrupt  # Ctrl-C while the new candidate trains
        return scripted(workload, name, seed, settings, **kw)

    monkeypatch.setattr(runner, "run_one", interrupted)
    argv = _compare(tmp_path, "--objective", "speed")
    argv[argv.index("--policies") + 1] = POLICIES + ",bf16_kahan"
    assert main(argv) == 130
    capsys.readouterr()
    # report judges the stored runs under the contract of the latest compare, not the
    # finished one before it, and lists the candidate that never ran
    assert main(["report", str(tmp_path)]) == 1, "incomplete evidence recommends nothing"
    out = capsys.readouterr().out
    assert "No recommendation, the experiment is incomplete:" in out
    assert "Objective: speed" in out and "objective memory" not in out.lower()
    assert "bf16_kahan" in out and "not run" in out
    # ... and train --policy-from refuses a results.json judged under another contract
    monkeypatch.setattr(runner, "run_one", scripted)
    assert main(_compare(tmp_path, "--objective", "memory")) == 0
    capsys.readouterr()
    contract = json.loads((tmp_path / "contract.json").read_text())
    contract["contract"]["objective"] = "speed"  # a later compare started, then stopped
    (tmp_path / "contract.json").write_text(json.dumps(contract))
    argv = ["train", "--policy-from", str(tmp_path), "--out", str(tmp_path / "t")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "was judged under another contract than" in err and "did not finish" in err


# ------------------------------------------- the optimizer (real runs, digits tiny)


@pytest.mark.parametrize(
    ("flags", "label", "cls"),
    [
        (
            ["--optimizer", "sgd", "--optimizer-args", "momentum=0.9,lr=0.05"],
            "sgd (momentum=0.9)",
            "SGD",
        ),
        (["--optimizer", "lion"], "lion", "Lion"),
        ([], "adamw", "AdamW"),
    ],
)
def test_each_optimizer_gets_a_recommendation_and_bf16_pure_is_rejected_alike(
    flags: list[str], label: str, cls: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34: compare judges policies for the optimizer named. A policy storing bf16
    without a master is refused on its update path for SGD and Lion as for AdamW."""
    argv = ["compare", "--workload", "digits", "--size", "tiny", "--seeds", "1"]
    argv += ["--max-seeds", "1", "--policies", "bf16_master,bf16_pure", "--out", str(tmp_path)]
    code = main([*argv, "--quiet", *flags])
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    decision = data["decision"]
    assert code == 0 and decision["status"] in ("recommended", "stay"), decision
    assert decision["recommended"] in ("fp32", "bf16_master") and decision["optimizer"] == label
    pure = decision["policies"]["bf16_pure"]["verdict"]
    assert pure["status"] == "rejected" and pure["gate"] == "update-path", pure
    assert (
        f"mixprec.optim.{cls} updates bf16 parameters with no full-precision master"
        in (pure["reason"])
    )
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*.json")]
    assert {r["optimizer"] for r in records} == {label}
    named = f"optimizer {label}"
    assert named in (tmp_path / "report.md").read_text()
    assert named in (tmp_path / "report.html").read_text()
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"recommended: {'stay on ' if decision['status'] == 'stay' else ''}")
    assert (f"for {named}" in last) == (label != "adamw"), last
    if label != "adamw":
        assert printed.startswith("Measured on") and f"With {named}: Recommended" in printed
