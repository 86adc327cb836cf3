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


def test_a_ctrl_c_held_while_the_block_raises_is_raised_with_the_error_as_context(
    python_sigint_handler: None,
) -> None:
    # Found by review: prec.step([o1, o2]) with o2 raising dropped the Ctrl-C, so a loop
    # catching the ValueError never stopped.
    with pytest.raises(KeyboardInterrupt) as caught, ctrl_c.held():
        os.kill(os.getpid(), signal.SIGINT)
        raise ValueError("inner")
    assert isinstance(caught.value.__context__, ValueError)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_the_program_installs_within_the_block_stays(
    python_sigint_handler: None,
) -> None:
    # Found by review: a step hook installing its own SIGINT handler had it replaced
    # by Python's default when the step ended.
    def mine(signum: int, frame: object) -> None:
        pass

    try:
        with ctrl_c.held():
            signal.signal(signal.SIGINT, mine)
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
