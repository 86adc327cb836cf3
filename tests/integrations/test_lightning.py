"""The Lightning plugins against mixprec's own loop, bitwise (issue 33).

A tiny HF Llama (built from a config) trains 40 steps on fixed byte-level
batches, once in the README loop and once under `lightning.Trainer` (or
`Fabric`) with the plugin: the losses, weights and optimizer state must be
bitwise the same, under ``bf16_master`` and under ``amp_fp16`` with a small
loss scale that grows every 3 steps (so that steps are skipped), with a NaN
injected into one step; the learning-rate schedule holds on skipped steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning", reason="the lightning extra is not installed")

from lightning_setup import (  # noqa: E402 - after the skip
    STEPS,
    ManualModule,
    Module,
    fabric_run,
    loader,
    own_loop,
    trainer,
)
from runs import bitwise, policy, same_state  # noqa: E402

import mixprec  # noqa: E402
from mixprec.integrations import lightning as integration  # noqa: E402


def _run_in_new_process(script: str, *args: str) -> None:
    tests = Path(__file__).parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent), env.get("PYTHONPATH", "")])
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        check=True,
        env=env,
        cwd=tests,
        timeout=300,
    )


@pytest.mark.parametrize("name", ["bf16_master", "amp_fp16"])
def test_trainer_is_bitwise_the_own_loop(name: str, tmp_path: Path) -> None:
    losses, lrs, model, _ = own_loop(name)
    prec = mixprec.Precision(policy(name))
    plugin = integration.MixprecPrecision(prec)
    module = Module(prec)
    trainer(plugin, tmp_path).fit(module, loader())
    assert bitwise(module.losses, losses)
    assert module.lrs == lrs  # the schedule held on the same skipped steps
    for mine, theirs in zip(module.model.parameters(), model.parameters(), strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    poisoned = 4  # POISONED batches in each of 2 epochs
    if name == "amp_fp16":  # the loss scale starts at 2**24: overflows are skipped too
        assert prec.stats.skipped_steps > poisoned
    else:
        assert prec.stats.skipped_steps == poisoned
    assert plugin.last_report is not None
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "mixprec/skipped_steps" in logged


def test_manual_optimization_with_clipping_is_bitwise_the_own_loop(tmp_path: Path) -> None:
    """``self.clip_gradients(opt, ...)`` gets the LightningOptimizer wrapper; the unscale
    must be the one the step sees (a second unscale shrank updates about 3.5x: review)."""
    losses, _, model, _ = own_loop("amp_fp16")
    prec = mixprec.Precision(policy("amp_fp16"))
    module = ManualModule(prec)
    run = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[integration.MixprecPrecision(prec)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    run.fit(module, loader())
    assert bitwise(module.losses, losses)
    for mine, theirs in zip(module.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", ["bf16_master", "amp_fp16"])
def test_fabric_is_bitwise_the_own_loop(name: str) -> None:
    losses, _, model, _ = own_loop(name)
    mine, net, _, _ = fabric_run(name)
    assert bitwise(mine, losses)
    for a, b in zip(net.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


#: Both resumes below in one new process (each new process spent its time importing
#: torch and Lightning): ``fabric.load`` of FABRIC_STATE, then ``fit(ckpt_path=...)``
#: of Lightning's checkpoint; the results go to OUT.
RESUME = """
import json, sys
from pathlib import Path
import torch
from lightning_setup import Module, fabric_run, loader, policy, trainer
import mixprec
from mixprec.integrations.lightning import MixprecPrecision
fabric_state, ckpt, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
losses, net, prec, opt = fabric_run("amp_fp16", save_at=20, path=fabric_state, resume=True)
json.dump({"losses": losses, "scale": prec.loss_scale}, open(out / "fabric.json", "w"))
torch.save({"model": net.state_dict(), "optimizer": opt}, out / "fabric.pt")
prec = mixprec.Precision(policy("amp_fp16"))
module = Module(prec)
run = trainer(MixprecPrecision(prec), out / "lightning")
run.fit(module, loader(), ckpt_path=ckpt)
json.dump({"losses": module.losses, "lrs": module.lrs, "scale": prec.loss_scale,
           "skipped": prec.stats.skipped_steps}, open(out / "lightning.json", "w"))
optimizer = run.optimizers[0].state_dict()["state"]
torch.save({"model": module.state_dict(), "optimizer": optimizer}, out / "lightning.pt")
"""


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted runs, each saving after step 20 of 40 (Fabric's ``fabric.save``
    and Lightning's own checkpoint), and both resumed in one new process."""
    tmp = tmp_path_factory.mktemp("resume")
    fabric_state = tmp / "state.ckpt"
    fabric = fabric_run("amp_fp16", save_at=20, path=str(fabric_state))
    checkpoint = pl.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(tmp / "ckpt"), every_n_train_steps=20, save_top_k=-1
    )
    prec = mixprec.Precision(policy("amp_fp16"))
    module = Module(prec)
    whole = trainer(integration.MixprecPrecision(prec), tmp, callbacks=[checkpoint])
    whole.fit(module, loader())
    [mid] = [p for p in (tmp / "ckpt").iterdir() if "step=20" in p.name]
    out = tmp / "resumed"
    out.mkdir()
    _run_in_new_process(RESUME, str(fabric_state), str(mid), str(out))
    return {"fabric": fabric, "lightning": (prec, module, whole), "out": out}


def test_a_fabric_save_resumes_bitwise_in_a_new_process(resumed: dict[str, Any]) -> None:
    """``fabric.save`` after step 20 (model, optimizer, scheduler and the plugin's loss
    scale), ``fabric.load`` in a new process: the rest of the run is the same."""
    losses, net, prec, opt = resumed["fabric"]
    out = resumed["out"]
    result = json.loads((out / "fabric.json").read_text())
    assert bitwise(result["losses"], losses[20:])
    assert result["scale"] == prec.loss_scale
    saved = torch.load(out / "fabric.pt", weights_only=True)
    assert same_state(saved["model"], net.state_dict())
    assert same_state(saved["optimizer"], opt)  # masters and moments


def test_a_lightning_checkpoint_resumes_bitwise_in_a_new_process(resumed: dict[str, Any]) -> None:
    """Lightning's own checkpoint, mid-run (after step 20 of 40), resumed in a new process
    continues as the uninterrupted run: losses, schedule, loss scale, weights and the
    optimizer's state (masters, moments)."""
    prec, module, whole = resumed["lightning"]
    out = resumed["out"]
    result = json.loads((out / "lightning.json").read_text())
    assert bitwise(result["losses"], module.losses[20:])
    assert result["lrs"] == module.lrs[20:]
    assert result["scale"] == prec.loss_scale
    saved = torch.load(out / "lightning.pt", weights_only=True)
    assert same_state(saved["model"], module.state_dict())
    assert same_state(saved["optimizer"], whole.optimizers[0].state_dict()["state"])


@pytest.mark.parametrize("flag", ["bf16-true", "16-mixed"])
def test_precision_flag_and_plugin_together_are_refused(flag: str) -> None:
    """Lightning's own precision would recast the fp32 islands (``bf16-true``) or add its
    own autocast and scaler (``16-mixed``): Lightning refuses it beside the plugin."""
    plugin = integration.MixprecPrecision("bf16_master")
    with pytest.raises(ValueError, match=f"Received both `precision={flag}`"):
        pl.Trainer(accelerator="cpu", precision=flag, plugins=[plugin])
