"""A child process's output, drained as it comes (its last characters kept for messages)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

__all__ = ["OutputTail"]

_TAIL_CHARS = 64 * 1024


class OutputTail:
    """Drains one pipe of a child in a background thread, keeping only its last `limit`
    characters (for error messages). An undrained pipe fills at about 64 KiB, and then the
    child blocks in its next write: a daemon that logs would freeze mid-test.

    `marker`: `seen` is set at the first line starting with it (or when the pipe ends), and
    `line` is that line."""

    def __init__(self, stream: Any, limit: int = _TAIL_CHARS, marker: str = "") -> None:
        self.limit = limit
        self.marker = marker
        self.seen = threading.Event()
        self.line = ""
        self._lines: deque[str] = deque()
        self._size = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._drain, args=(stream,), daemon=True,
                                        name="output-tail")
        self._thread.start()

    def _drain(self, stream: Any) -> None:
        try:
            for line in iter(stream.readline, ""):
                if self.marker and not self.line and line.startswith(self.marker):
                    self.line = line
                    self.seen.set()
                with self._lock:
                    self._lines.append(line)
                    self._size += len(line)
                    while self._size > self.limit and len(self._lines) > 1:
                        self._size -= len(self._lines.popleft())
        except (OSError, ValueError):
            pass  # the pipe was closed under us
        finally:
            self.seen.set()

    @property
    def done(self) -> bool:
        """The pipe ended (the child exited or closed it) and everything was read."""
        return not self._thread.is_alive()

    def join(self, timeout_s: float = 5.0) -> None:
        self._thread.join(timeout_s)

    def text(self) -> str:
        """The last `limit` characters or so (whole lines)."""
        with self._lock:
            return "".join(self._lines)[-self.limit:]
