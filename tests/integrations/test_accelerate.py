"""The Accelerate loop against mixprec's own loop, bitwise (issue 33).

A tiny HF Llama trains 40 steps of 2 accumulated micro-batches, once in the
README loop and once in an Accelerate loop through `AcceleratedPrecision`:
losses, learning rates and weights must be bitwise the same, under
``bf16_master`` and ``amp_fp16`` (a loss scale starting at 2**24, so that
overflowing steps are skipped), with NaNs injected into three micro-batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="the accelerate extra is not installed")

from accelerate_setup import (  # noqa: E402 - after the skip
    ACCUMULATE,
    MICRO,
    accelerate_run,
    own_loop,
)
from runs import LR, bitwise, same_state, schedule  # noqa: E402

import mixprec  # noqa: E402
from mixprec.integrations.accelerate import AcceleratedPrecision  # noqa: E402


@pytest.mark.parametrize("name", ["bf16_master", "amp_fp16"])
def test_the_accelerate_loop_is_bitwise_the_own_loop(name: str) -> None:
    losses, lrs, model = own_loop(name)
    mine, my_lrs, net, prec, _ = accelerate_run(name)
    assert bitwise(mine, losses) and my_lrs == lrs and len(lrs) == MICRO // ACCUMULATE
    for a, b in zip(net.parameters(), model.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    before = [LR * schedule(0), *lrs[:-1]]  # the rate each step ran at
    held = sum(x == y for x, y in zip(before, lrs, strict=True))
    assert prec.stats.skipped_steps == held >= 3  # every skip held the schedule


def test_an_accelerator_with_its_own_mixed_precision_is_refused() -> None:
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match=r"mixed_precision='bf16'.*mixed_precision='no'"):
        AcceleratedPrecision(acc, mixprec.Precision("bf16_master"))


def test_a_policy_that_releases_gradients_is_refused_when_the_loop_is_built() -> None:
    acc = accelerate.Accelerator(cpu=True)
    with pytest.raises(
        mixprec.PrecisionError, match=r"^AcceleratedPrecision with policy 'bf16_lean4'"
    ):
        AcceleratedPrecision(acc, "bf16_lean4")


RESUME = """
import json, sys
import torch
from accelerate_setup import accelerate_run
losses, lrs, model, prec, opt = accelerate_run("amp_fp16", save_at=40, resume=sys.argv[1])
json.dump({"losses": losses, "lrs": lrs, "scale": prec.loss_scale}, open(sys.argv[2], "w"))
torch.save({"model": model.state_dict(), "optimizer": opt}, sys.argv[3])
"""


def test_save_state_resumes_bitwise_in_a_new_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    losses, lrs, model, prec, opt = accelerate_run("amp_fp16", save_at=40, out=str(state))
    tests = Path(__file__).parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent), env.get("PYTHONPATH", "")])
    out, weights = tmp_path / "resumed.json", tmp_path / "weights.pt"
    subprocess.run(
        [sys.executable, "-c", RESUME, str(state), str(out), str(weights)],
        check=True,
        env=env,
        cwd=tests,
        timeout=300,
    )
    resumed = json.loads(out.read_text())
    assert bitwise(resumed["losses"], losses[40:])
    assert resumed["lrs"] == lrs[20:]
    assert resumed["scale"] == prec.loss_scale
    saved = torch.load(weights, weights_only=True)
    assert same_state(saved["model"], model.state_dict())
    assert same_state(saved["optimizer"], opt)  # masters and moments


class Recorder(accelerate.tracking.GeneralTracker):  # type: ignore[misc]
    """An Accelerate tracker that keeps what it is given."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def tracker(self) -> Recorder:
        return self

    def store_init_configuration(self, values: dict[str, object]) -> None:
        pass

    def log(self, values: dict[str, float], step: int | None = None, **_: object) -> None:
        self.logged.append((step, values))


def test_skips_and_the_loss_scale_reach_the_accelerators_trackers() -> None:
    recorder = Recorder()
    accelerator = accelerate.Accelerator(cpu=True, log_with=[recorder])
    accelerator.init_trackers("mixprec")
    scaling = mixprec.LossScaling(init_scale=2.0**10)
    prec = mixprec.Precision(mixprec.preset("amp_fp16").replace(loss_scaling=scaling))
    model = prec.prepare(torch.nn.Linear(4, 1))
    opt = accelerator.prepare(prec.optimizer(model, lr=0.1))
    loop = AcceleratedPrecision(accelerator, prec)
    for poison in (1.0, float("nan"), 1.0):
        with prec.autocast():
            loss = model(torch.ones(2, 4)).float().sum() * poison
        loop.backward(loss)
        loop.step(opt)
    skipped = [values["mixprec/skipped_steps"] for _, values in recorder.logged]
    assert [step for step, _ in recorder.logged] == [0, 1, 2]
    assert skipped == [0.0, 1.0, 1.0]
    assert recorder.logged[1][1]["mixprec/loss_scale"] == 2.0**9  # backed off once
