"""Tiny digits whose batch of step 3 waits for a stop request (`test_train`).

With ``MIXPREC_TEST_MARKER`` set to a path, ``train_batch(step=3)`` touches that
file and waits there, inside step 3, until Ctrl-C or SIGTERM has been received
(at most 60 s). A test sends the real signal once the file exists: the signal
lands while a step is in progress, on every machine, however fast it trains.
Without the variable this is tiny digits, bitwise.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from mixprec.cli.interrupt import INTERRUPTED, TERMINATED
from mixprec.workloads import Workload, load_workload

__all__ = ["WAIT_AT", "make_workload"]

#: The step whose batch waits for the signal.
WAIT_AT = 3


def make_workload() -> Workload:
    """Tiny digits; see the module docstring."""
    base = load_workload("digits", size="tiny")

    def train_batch(
        *, step: int, seed: int, batch_size: int, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        marker = os.environ.get("MIXPREC_TEST_MARKER")
        if marker and step == WAIT_AT:
            Path(marker).touch()
            deadline = time.monotonic() + 60
            while not (INTERRUPTED.is_set() or TERMINATED.is_set()):
                assert time.monotonic() < deadline, "no signal came"
                time.sleep(0.01)
        return base.train_batch(step=step, seed=seed, batch_size=batch_size, device=device)

    return dataclasses.replace(base, train_batch=train_batch)
