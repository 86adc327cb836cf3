"""`mixprec train --nproc 2` and the same command under torchrun: data-parallel runs
on 2 gloo ranks, stopped by SIGTERM while a step is in progress and resumed,
bitwise equal to a run never stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixprec.cli import main

from .test_train import (
    HERE,
    _assert_bitwise,
    _cli,
    _env,
    _exported,
    _final_state,
    _finish,
    _metrics,
)

SPEC = "signal_workload:make_workload"  # tiny digits; step 4 waits for a signal


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_ranks_stopped_by_sigterm_resume_bitwise_equal_to_a_torchrun_run(
    tmp_path: Path,
    strategy: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = ["train", "--workload", SPEC, "--policy", "bf16_master", "--steps", "10"]
    run += ["--strategy", strategy]
    whole, stopped, marker = tmp_path / "whole", tmp_path / "stopped", tmp_path / "waiting"
    # The run never stopped, under torchrun (which runs the module on each of its ranks).
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", "-m", "mixprec", *run, "--out", str(whole)]
    never = subprocess.Popen(
        torchrun, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    proc = _cli(*run, "--out", str(stopped), "--nproc", "2", MIXPREC_TEST_MARKER=str(marker))
    deadline = time.monotonic() + 120
    while not marker.exists():  # step 4 is in progress on the ranks
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to every rank
    code, _, err = _finish(proc)
    assert code == 143, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        f"mixprec train: stopped (SIGTERM) after step 4 of 10; checkpoint "
        f"{stopped / 'checkpoints' / 'step_00000004'}; resume with: mixprec train --workload "
        f"{SPEC} --nproc 2 --strategy {strategy} --out {stopped} --resume"
    )
    assert [line["step"] for line in _metrics(stopped)] == [1, 2, 3, 4]
    # Found in issue 30: a resume without --nproc went on in one process without a word.
    # (Refused before training: this process, not a new one, runs it.)
    monkeypatch.syspath_prepend(str(HERE))  # signal_workload
    capsys.readouterr()
    code = main(["train", "--workload", SPEC, "--out", str(stopped), "--resume"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    assert err == (
        f"mixprec: error: {stopped / 'checkpoints' / 'step_00000004'} was saved by 2 ranks "
        f"and this run has 1: resume with --nproc 2 --strategy {strategy}, or pass --nproc 1 "
        "to go on in one process (equal within the reduction order)\n"
    )

    resume = ["train", "--workload", SPEC, "--nproc", "2", "--strategy", strategy]
    code, out, err = _finish(_cli(*resume, "--out", str(stopped), "--resume", "--json"))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["status"] == "finished" and summary["step"] == 10
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    code, _, err = _finish(never)
    assert code == 0, err
    assert _metrics(stopped) == _metrics(whole)  # every step's loss (mean over ranks), norm
    _assert_bitwise(_final_state(stopped, "bf16_master"), _final_state(whole, "bf16_master"))
    _assert_bitwise(_exported(stopped), _exported(whole))


def test_a_batch_that_does_not_divide_among_the_ranks_exits_2_naming_the_multiple(
    tmp_path: Path,
) -> None:
    recipe = tmp_path / "odd.yaml"
    recipe.write_text("workload: digits\npolicy: bf16_master\nsteps: 4\nbatch_size: 63\n")
    run = ["train", "--config", str(recipe), "--nproc", "2", "--out", str(tmp_path / "o")]
    code, _, err = _finish(_cli(*run))
    assert code == 2
    lines = sorted(err.strip().splitlines())
    assert len(lines) == 2 and "Traceback" not in err
    assert lines[0].startswith("mixprec (rank 1): error: batch_size 63 does not divide")
    assert lines[1].startswith("mixprec: error: batch_size 63 does not divide among 2 ranks")
    assert "multiple of 2" in lines[1]
