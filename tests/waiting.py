"""The one place tests may wait: poll a condition, fail with a message naming what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    interval_s: float = 0.02,
    what: str = "condition",
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Raises TimeoutError naming ``what`` (and the last falsy value) after ``timeout_s``. The
    predicate is always tried once more at the deadline, so a slow poll cannot lose a late win.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"timed out after {timeout_s:g}s waiting for {what} (last: {result!r})"
            )
        time.sleep(interval_s)
