"""A save killed with SIGKILL at any point never costs the previous checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.checkpoint import loop
from tests.checkpoint.test_resume import CHILD, _child_env

from mixprec import checkpoint

N = 3

#: Where the second save dies, and the step `latest` must then name.
PHASES = {
    "dcp-metadata": N,  # data file written, DCP's .metadata not yet
    "data-written": N,  # DCP done, no manifest
    "manifest-written": N,  # complete in the temporary directory, not renamed
    "renamed": N,  # step_2N complete in place, `latest` not yet moved
    "latest-moved": 2 * N,  # before the old checkpoint is pruned
    "pruned": 2 * N,
}


@pytest.mark.slow
def test_a_killed_save_leaves_a_checkpoint_that_resumes_exactly(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    loop.seed_everything()
    model, optimizer, prec = loop.build("bf16_master")
    reference = loop.train(model, optimizer, prec, 0, 3 * N)
    final = loop.snapshot(model, optimizer)

    children = {
        phase: subprocess.Popen(
            [sys.executable, str(CHILD), "kill", str(tmp_path / phase), str(N), phase],
            env=_child_env(),
            stderr=subprocess.PIPE,
        )
        for phase in PHASES
    }
    for phase, child in children.items():
        _, err = child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL, (phase, err.decode()[-500:])

    for phase, step in PHASES.items():
        root = tmp_path / phase
        assert checkpoint.verify(root / f"step_{step:08d}").step == step
        model, optimizer, prec = loop.build("bf16_master")
        loaded = checkpoint.load(root, model=model, optimizer=optimizer, precision=prec)
        assert loaded["step"] == step, phase
        losses = loop.train(model, optimizer, prec, step, 3 * N)
        assert losses == reference[step:], phase
        got = loop.snapshot(model, optimizer)
        for key, value in final.items():
            assert torch.equal(loop.bits(value), loop.bits(got[key])), (phase, key)
        # The next save clears what the killed one left and keeps `latest` valid.
        checkpoint.save(root, model=model, optimizer=optimizer, precision=prec, step=3 * N)
        assert not [p for p in root.iterdir() if p.name.startswith(".")], phase
        assert (
            checkpoint.load(root, model=model, optimizer=optimizer, precision=prec)["step"] == 3 * N
        )


def test_a_checkpoint_latest_never_named_is_not_taken(tmp_path: Path) -> None:
    """Killed between the rename and the pointer: `latest` and `latest-valid` both
    take the older checkpoint, which the pointer names and which verifies."""
    model, optimizer, prec = loop.build("bf16_master")
    loop.train(model, optimizer, prec, 0, 1)
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=prec, step=1)
    loop.train(model, optimizer, prec, 1, 2)
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=prec, step=2)
    (tmp_path / "latest").write_text("step_00000001\n")  # as if killed before it moved
    for resume in ("latest", "latest-valid"):
        got = checkpoint.load(tmp_path, model=model, optimizer=None, precision=None, resume=resume)
        assert got["step"] == 1, resume


def test_after_a_rollback_the_abandoned_checkpoints_are_neither_taken_nor_kept(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, 7):
        checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=None, step=step)
    checkpoint.load(tmp_path, model=model, optimizer=optimizer, precision=None, resume=2)
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=None, step=3)
    assert checkpoint.resolve(tmp_path, "latest").step == 3
    assert checkpoint.resolve(tmp_path, "latest-valid").step == 3
    (tmp_path / "step_00000003" / "manifest.json").unlink()  # latest broken: its line's
    with pytest.warns(checkpoint.CheckpointWarning):
        assert checkpoint.resolve(tmp_path, "latest-valid").step == 2
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=None, step=3)
    checkpoint.save(tmp_path, model=model, optimizer=optimizer, precision=None, step=4, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step_00000003",
        "step_00000004",
    ]
