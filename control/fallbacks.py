"""What the appliance gave up on this host, and why: each fallback logged once at INFO and
listed by `reductionctl status`.

A fallback is the product working, only less well than it could: reduce kernels slower than the
best (torch did not load), results by unicast fan-out (no multicast route), one send per
datagram (the kernel refused UDP GSO). An operator should learn of each without reading code,
and exactly once, not per core or per second: the daemon's start and every core report theirs,
and this record keeps one line per distinct fallback with the cores that took it.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["Fallbacks"]

_log = logging.getLogger("reductiond")


class Fallbacks:
    """Thread-safe: cores report from the supervisor's threads, status reads from the API's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[str, set[int]] = {}  # what -> cores that took it (empty: the daemon)

    def note(self, what: str, core: int | None = None) -> None:
        """Record a fallback (a sentence saying what and why); the first time it is seen it is
        logged, whichever core reports it."""
        with self._lock:
            cores = self._taken.get(what)
            first = cores is None
            if cores is None:
                cores = self._taken[what] = set()
            if core is not None:
                cores.add(core)
        if first:
            _log.info("fallback%s: %s", "" if core is None else f" (core {core})", what)

    def describe(self) -> tuple[str, ...]:
        """One line per fallback, naming the cores that took it."""
        with self._lock:
            taken = sorted(self._taken.items())
        return tuple(what if not cores else
                     f"{what} (core{'s' if len(cores) > 1 else ''} "
                     f"{', '.join(map(str, sorted(cores)))})"
                     for what, cores in taken)
