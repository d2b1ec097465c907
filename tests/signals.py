"""Signal dispositions as a terminal gives them, for the tests that stop a process by a signal.

A suite started in the background by a script (`bash scripts/test &`: no job control, so the
shell ignores SIGINT and SIGQUIT for it) or under `nohup` (SIGHUP ignored) hands those
dispositions to pytest and to every process it starts; a signal a test sends is then dropped.
Where the program under test keeps a signal ignored, it does right (a nohup'd run must outlive
its terminal), so each such test sets what a terminal gives for as long as it runs, and
processes it starts meanwhile inherit it. (2026-12-07: a suite run under `nohup ... &` failed
three such tests and hung in a fourth, its signal dropped.)"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

TERMINAL = {
    signal.SIGINT: signal.default_int_handler,  # Python's own for SIGINT: KeyboardInterrupt
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGHUP: signal.SIG_DFL,
}


@contextlib.contextmanager
def as_from_a_terminal() -> Iterator[None]:
    """Within the block, SIGINT raises KeyboardInterrupt and SIGTERM and SIGHUP have their
    defaults, whatever this process inherited; the dispositions it had come back after."""
    before = {signum: signal.signal(signum, handler) for signum, handler in TERMINAL.items()}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
