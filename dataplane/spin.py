"""How long an idle core in `adaptive` poll mode spins before it blocks (dataplane/loop.py).

Spinning buys latency only when a datagram arrives during the spin; when the gaps between bursts
are longer, every spin is CPU thrown away, and on a machine the core shares with other
processes (the emulated racks; a small appliance) it is CPU they lack. A DDP run at 1 Gbit/s on
the rack (4 ranks, one core) showed both kinds of gap: of 11,400 idle periods, 76% lasted longer
than a 200 us spin (ranks computing, buckets apart), while 24% ended within it.

So the window adapts as Linux's haltpoll governor adapts a guest's halt polling
(Documentation/virt/guest-halt-polling.rst), from what each idle period turned out to be:

* it ended within the window: the spin caught it; the window stays;
* it ended after the window but within the limit (`spin_us`): a longer spin would have caught
  it, so the window grows (to `GROW_START_S` at first, then doubling, up to the limit);
* it ended after the limit: no spin we allow would have caught it, so the window halves, and
  falls to zero below `GROW_START_S`.

A steady stream keeps the window where it catches the stream; long silences take it to zero,
and the first short gap after them starts it again. Sans-I/O: durations in, a duration out.

After the spin the loop blocks in `select`. A transport whose arrivals wake the select (a UDP
socket) blocks up to the mailbox bound at once. One whose arrivals cannot (RDMA completions: no
completion-channel descriptor in the pyverbs we run on) must poll again after each block, so
`IdleBlocks` makes its blocks short while traffic may be near and long once it is not:

* from `first_s`, doubling after each empty poll, up to the transport's `idle_block_s`: while
  the core has been idle for less than `DEEP_IDLE_S`, a completion waits at most that long;
* once it has been idle for `DEEP_IDLE_S`, up to `deep_s` (the mailbox bound): a silent core
  then wakes a few dozen times per second, not several hundred.

In the soft-RoCE guest (emulated CPUs) an idle appliance with one RoCE core used 41-44% of a
CPU with the 2 ms ceiling alone, and 6% for its core (1.5% for the daemon) with these deeper
blocks. The first completion after a long silence waits up to `deep_s` (50 ms) once; a
training job's steps are far closer together than `DEEP_IDLE_S`.
"""

from __future__ import annotations

__all__ = ["DEEP_IDLE_S", "GROW_START_S", "IdleBlocks", "SpinWindow"]

GROW_START_S = 25e-6  # the window's first step up from zero: a few receive calls' worth
DEEP_IDLE_S = 5.0  # idle this long, a core without a wakeup descriptor blocks up to deep_s
_GROW = 2.0
_SHRINK = 2.0


class SpinWindow:
    """The spin of one core's idle loop: `window_s` now, between 0 and `limit_s`."""

    def __init__(self, limit_s: float) -> None:
        if limit_s < 0:
            raise ValueError(f"a spin limit is at least 0 s, not {limit_s}")
        self.limit_s = limit_s
        self._grow_start_s = min(GROW_START_S, limit_s)
        self.window_s = limit_s  # as a fixed spin would: the first periods set it
        self.grown = 0  # times it grew and shrank (what tests look at)
        self.shrunk = 0

    def idle_ended(self, idle_s: float) -> None:
        """A datagram came `idle_s` seconds after the loop first found nothing to do."""
        window = self.window_s
        if idle_s <= window:
            return
        if idle_s <= self.limit_s:
            self.window_s = min(self.limit_s, max(self._grow_start_s, window * _GROW))
            self.grown += 1
        elif window > 0.0:
            window /= _SHRINK
            self.window_s = window if window >= self._grow_start_s else 0.0
            self.shrunk += 1


class IdleBlocks:
    """How long each `select` of one idle spell blocks: `first_s`, doubling after each, up to
    `longest_s`, and up to `deep_s` once the spell has lasted `DEEP_IDLE_S` (see above)."""

    def __init__(self, first_s: float, longest_s: float, deep_s: float) -> None:
        if not 0 < first_s <= longest_s <= deep_s:
            raise ValueError(f"blocks need 0 < first {first_s} <= longest {longest_s} "
                             f"<= deep {deep_s}")
        self.first_s, self.longest_s, self.deep_s = first_s, longest_s, deep_s
        self.block_s = first_s

    def restart(self) -> None:
        """Work came: the next idle spell starts from the shortest block."""
        self.block_s = self.first_s

    def blocked(self, idle_s: float) -> None:
        """A block ended with nothing to do, `idle_s` seconds into the idle spell."""
        ceiling = self.longest_s if idle_s < DEEP_IDLE_S else self.deep_s
        self.block_s = min(ceiling, self.block_s * 2)
