"""SIGTERM and SIGHUP unwind a lab's with-blocks as Ctrl-C does (deploy.testnet.unwind)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import pytest

from reduction_appliance.deploy.testnet.unwind import Terminated, unwinding_on_termination
from tests.signals import as_from_a_terminal


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_termination_inside_the_block_raises_and_a_second_one_cannot_cut_the_unwinding_short(
        signum: int) -> None:
    unwound = []
    with as_from_a_terminal():
        with pytest.raises(Terminated) as stopped, unwinding_on_termination():
            try:
                os.kill(os.getpid(), signum)  # (delivered at the next bytecode, in this thread)
                pytest.fail("the signal did not stop the block")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # while tearing down: ignored
                os.kill(os.getpid(), signal.SIGHUP)
                unwound.append(True)
        assert unwound == [True] and stopped.value.signum == signum
        assert isinstance(stopped.value, KeyboardInterrupt)  # the commands' "interrupted" path
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_a_signal_the_process_was_started_ignoring_stays_ignored() -> None:
    """Under `nohup` SIGHUP is ignored from the start: a run must outlive its terminal then."""
    with as_from_a_terminal():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with unwinding_on_termination():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def test_a_programs_own_handler_is_left_alone_and_nesting_restores_once() -> None:
    heard: list[int] = []

    def own(signum: int, frame: FrameType | None) -> None:
        heard.append(signum)

    previous = signal.signal(signal.SIGHUP, own)
    try:
        with unwinding_on_termination(), unwinding_on_termination():
            os.kill(os.getpid(), signal.SIGHUP)
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert heard == [signal.SIGHUP]
        assert signal.getsignal(signal.SIGHUP) is own
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_outside_the_main_thread_nothing_is_installed() -> None:
    seen: list[object] = []

    def inside() -> None:
        with unwinding_on_termination():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=inside)
    thread.start()
    thread.join()
    assert seen == [signal.SIG_DFL]


def test_a_child_forked_inside_the_block_dies_of_the_signal_as_before() -> None:
    """pyroute2 forks helpers into namespaces and stops them with SIGTERM: one that raised
    instead of dying left the lab's build waiting in netlink forever."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    with unwinding_on_termination():
        child = os.fork()
        if child == 0:  # pragma: no cover (the child's own code)
            try:
                os.write(ready_w, b"x")
                os.read(hold_r, 1)  # until signalled
            finally:
                os._exit(0)  # (reached only where the handler raised)
        try:
            os.read(ready_r, 1)
            os.kill(child, signal.SIGTERM)
            _, status = os.waitpid(child, 0)
        finally:
            for fd in (ready_r, ready_w, hold_r, hold_w):
                os.close(fd)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
