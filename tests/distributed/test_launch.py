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
