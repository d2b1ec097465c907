"""Rank processes for tests/roce/test_daemon.py, forked from a server that has already imported
tests.roce.worker (numpy, ml_dtypes, the plugin). In the emulated guest a fresh interpreter
takes 10-20 s to import them, and the tests start about 40 ranks; a fork takes well under a
second. Each rank is still its own process with its own queue pairs, running the same
`tests.roce.worker.main` that `python -m tests.roce.worker` runs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from tests.roce import worker

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests.roce.worker"])


def _rank(argv: list[str], stderr_path: str, release: Connection | None) -> None:
    """The child: stderr to a file the test reads, stdin from the test's release pipe (a held
    rank waits for it to close), then the worker's own main."""
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(err)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 (fd 2: lives on)
    if release is not None:
        sys.stdin = open(release.fileno(), closefd=False)  # noqa: SIM115
    sys.argv = ["tests.roce.worker", *argv]
    code = worker.main()
    sys.stderr.flush()
    os._exit(code)  # the forkserver's atexit handlers (multiprocessing's own) are not ours to run


class Rank:
    """One forked rank process."""

    def __init__(self, argv: list[str], stderr_path: Path, hold: bool) -> None:
        self._stderr_path = stderr_path
        reader, self._release = _CONTEXT.Pipe(duplex=False) if hold else (None, None)
        # daemon: a rank a failed test left running is terminated when pytest exits, instead of
        # multiprocessing's exit joining it (a held rank would wait forever).
        self._process = _CONTEXT.Process(target=_rank, args=(argv, str(stderr_path), reader),
                                         daemon=True)
        self._process.start()
        if reader is not None:
            reader.close()  # the child holds its own copy

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> tuple[int, str]:
        """Its exit code and stderr, once it exits (a held rank's stdin is closed first: it
        exits); subprocess.TimeoutExpired if it still runs after `timeout` seconds."""
        if self._release is not None:
            self._release.close()  # a held rank's stdin ends: it exits
            self._release = None
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self._process.pid}", timeout or 0.0)
        return code, self._stderr_path.read_text(errors="replace")
