"""A text progress bar on stderr: cases done / total, elapsed, ETA. No dependency.

On a terminal the bar redraws in place and steps aside for lines printed to stdout; into a file
or pipe (CI logs) it writes one line per update instead of carriage-return noise.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_bar", "format_duration"]

_WIDTH = 24


def format_duration(seconds: float) -> str:
    """m:ss below an hour, h:mm:ss above."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_bar(done: int, total: int, elapsed_s: float, label: str = "",
               width: int = _WIDTH) -> str:
    """`[#########...............]  9/24 cases  elapsed 0:41  ETA 1:08  label`.

    The ETA assumes the remaining cases take as long on average as the finished ones; sizes grow
    geometrically in a sweep, so it is optimistic early on, and "?" before the first case ends.
    """
    total = max(total, 1)
    done = min(max(done, 0), total)
    filled = width * done // total
    eta = format_duration(elapsed_s / done * (total - done)) if done else "?"
    width_n = len(str(total))
    text = (f"[{'#' * filled}{'.' * (width - filled)}] {done:>{width_n}}/{total} cases  "
            f"elapsed {format_duration(elapsed_s)}  ETA {eta}")
    return f"{text}  {label}" if label else text


class ProgressBar:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.label = ""
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._start = time.monotonic()
        self._drawn = False
        self._logged = -1

    def update(self, done: int | None = None, label: str | None = None) -> None:
        if done is not None:
            self.done = done
        if label is not None:
            self.label = label
        line = format_bar(self.done, self.total, time.monotonic() - self._start, self.label)
        if self._tty:
            self._stream.write("\r\x1b[2K" + line)
            self._drawn = True
        elif self.done != self._logged:  # a log gets one line per finished case, no more
            self._logged = self.done
            self._stream.write(line + "\n")
        self._stream.flush()

    def advance(self, label: str | None = None) -> None:
        self.update(self.done + 1, label)

    def clear(self) -> None:
        """Erase the bar (terminal only) so a line printed next starts at column 0."""
        if self._tty and self._drawn:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()
            self._drawn = False

    def close(self) -> None:
        if self._tty and self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False
