"""The local launcher's exit status (found by review: a rank ended by a second
SIGTERM made the launcher exit 241, not 143)."""

from __future__ import annotations

import signal

import pytest

from mixprec.distributed.launch import _exit_code


@pytest.mark.parametrize(
    ("returncode", "status"),
    [(0, 0), (2, 2), (143, 143), (-signal.SIGTERM, 143), (-signal.SIGABRT, 134)],
)
def test_a_rank_ended_by_a_signal_reports_128_plus_the_signal(returncode: int, status: int) -> None:
    assert _exit_code(returncode) == status


def test_wrapping_without_a_process_group_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: the From Python recipe run as a plain script (a world of 1, where
    process_group does nothing) raised torch's 'Default process group has not been
    initialized' from ddp and 'environment variable RANK expected' from shard."""
    from torch import nn

    from mixprec.distributed import ddp, process_group, shard

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with process_group("cpu") as device:
        assert device == "cpu"
        for wrap in (ddp, shard):
            with pytest.raises(ValueError, match=r"needs a process group.*torchrun"):
                wrap(nn.Linear(4, 4), "bf16_master")


def test_process_group_refuses_a_partial_environment_and_a_missing_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: RANK without WORLD_SIZE made every rank a world of 1; 'gpu' and 'cuda'
    on a machine without CUDA were yielded as they were (or failed in torch)."""
    import torch

    from mixprec.distributed import process_group

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="RANK='1' is set but WORLD_SIZE is not"), process_group():
        pass
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="'gpu' is not a torch device"), process_group("gpu"):
        pass
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"), process_group("cuda"):
            pass
