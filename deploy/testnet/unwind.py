"""A terminated lab run tears down what it built, as an interrupted one does.

Labs, loopback namespaces and the daemons started in them are context managers: Ctrl-C
(KeyboardInterrupt) unwinds them. SIGTERM (`timeout`, `kill`, a CI job cancelled, systemd) and
SIGHUP (the terminal closed) killed the process outright instead: `reductionctl bench` stopped
with SIGTERM left its rack's six namespaces and a reductiond with its cores running inside
them, for good. Inside `unwinding_on_termination()` either signal raises `Terminated` (a
KeyboardInterrupt, so the commands' "interrupted" handling applies) in the main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "unwinding_on_termination"]

_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a lab was up: raised to unwind it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name}: stopping, tearing the lab down")
        self.signum = signum


_installed_by: int | None = None  # the pid whose lab the handler unwinds


def _raise(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _installed_by:
        # A forked child (pyroute2 runs its netns helpers so) inherits the handler: it must
        # die of the signal as before, or its parent, which stops it with SIGTERM, waits
        # forever (the lab's build hung in pyroute2's netlink call).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    # Once: a second signal (people send two) must not cut the teardown it started short.
    for other in _SIGNALS:
        if signal.getsignal(other) is _raise:
            signal.signal(other, signal.SIG_IGN)
    raise Terminated(signum)


@contextlib.contextmanager
def unwinding_on_termination() -> Iterator[None]:
    """Within the block, the first SIGTERM or SIGHUP raises `Terminated` in the main thread,
    and later ones are ignored while the block unwinds. Only where the signal has its default
    action (a program's own handler is left alone, and so is an outer block's), and only in
    the main thread (the only one Python delivers signals to); the default comes back at the
    block's end."""
    global _installed_by
    installed = []
    if threading.current_thread() is threading.main_thread():
        _installed_by = os.getpid()
        for signum in _SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _raise)
                installed.append(signum)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for signum in installed:
                signal.signal(signum, signal.SIG_DFL)
