"""Child process of the checkpoint tests.

* ``child.py resume ROOT STEPS OUT PRESETS``: load each preset's checkpoint under
  ROOT/<preset> in this new process, train to STEPS, write losses and state to OUT.
* ``child.py kill ROOT N PHASE``: train N steps and save, train N more and save
  again, killing this process with SIGKILL when the second save reaches PHASE.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import loop
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from mixprec.checkpoint import saving


def _die(*args: Any, **kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill(root: Path, n: int, phase: str) -> None:
    loop.seed_everything()
    model, optimizer, prec = loop.build("bf16_master")
    loop.train(model, optimizer, prec, 0, n)
    saving.save(root, model=model, optimizer=optimizer, precision=prec, step=n, keep_last=1)
    loop.train(model, optimizer, prec, n, 2 * n)
    if phase == "dcp-metadata":  # between DCP's data file and its .metadata
        FileSystemWriter.finish = _die  # type: ignore[method-assign]
    else:
        saving._reached = lambda reached: _die() if reached == phase else None
    saving.save(root, model=model, optimizer=optimizer, precision=prec, step=2 * n, keep_last=1)
    raise SystemExit("the save finished: the phase was never reached")


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "kill":
        kill(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    command, root, steps, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    assert command == "resume"
    results = {}
    for policy in sys.argv[5].split(","):
        losses, state = loop.load_then_run(policy, root / policy, steps)
        results[policy] = {"losses": torch.tensor(losses, dtype=torch.float64), **state}
    torch.save(results, out)


if __name__ == "__main__":
    main()
