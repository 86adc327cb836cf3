"""`mixprec.ctrl_c.held`: a Ctrl-C within the block is raised after it."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mixprec import ctrl_c


@pytest.fixture
def python_sigint_handler():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_in_the_block_is_raised_after_it(python_sigint_handler: None) -> None:
    done = []
    with pytest.raises(KeyboardInterrupt), ctrl_c.held():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("rest of the block")
    assert done == ["rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_ctrl_c_nothing_is_raised_and_the_handler_is_back(
    python_sigint_handler: None,
) -> None:
    with ctrl_c.held():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_in_the_block_propagates_rather_than_the_held_ctrl_c(
    python_sigint_handler: None,
) -> None:
    with pytest.raises(ValueError, match="inner"), ctrl_c.held():
        os.kill(os.getpid(), signal.SIGINT)
        raise ValueError("inner")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_programs_own_handler_is_left_alone() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with ctrl_c.held():
            os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_it_holds_nothing(python_sigint_handler: None) -> None:
    handlers = []

    def run() -> None:
        with ctrl_c.held():
            handlers.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert handlers == [signal.default_int_handler]
