"""A worker's congestion window per appliance core: how many segments it keeps in flight to
the core, every round together, shrunk while a queue stands on the path and grown back while
none does (delay-based AIMD, as Swift has it).

The signal. A result's round trip is mostly the wait for the slowest rank, not the path: a
rank's sample says nothing about queues unless its own contribution was the one the slot
waited for. So the appliance names, in each RESULT, the rank whose contribution completed it
(wire.py), and only that rank takes the round trip of its payload as a delay sample: its
contribution found every other one already there, so what it waited for was the path (its own
uplink, the appliance's link, the core's socket). The sample ends when the result reached the
worker's host (the kernel's receive time, where it says: plugin/answers.py), not when the worker
read it: a result left in the socket while the worker's process was not running (a GC pause, a
busy GIL, two cores shared by nine processes here) found no queue on the path, as Swift keeps
the endpoint's delay apart from the fabric's. That rank's contributions then carry what it
found (wire.Flags.QUEUED) and the appliance echoes it in the RESULTs they complete, so every
rank hears of the queue, as ECN's echo has it. Without the echo only the completers shrank
their windows; the others kept theirs whole, and each round's first burst overflowed the queue
again (tests/unit/test_congestion.py).

The window. It starts at the job's whole window (the core's slots), so a clean path with a
fat uplink runs exactly as without it; or at what the worker's receive buffer holds, where
that is less (`fitting_window`), and never grows past it. A sample longer than the `target`
round trip cuts the window in proportion to the excess, by at most `max_decrease`; an echoed
mark, which carries no measure of the excess, by `mark_decrease`; either at most once per
round trip. Every answer while no queue stands grows it by 1/window (one segment per round
trip). Random loss does not cut it: a loss is no queue, and 1% loss must keep 70% of the
lossless throughput.

Deadlock freedom (plugin/session.py applies the gate): a slot completes only once every rank
sent its segment, so two ranks that filled their windows with different segments would wait
for each other forever. A round's lowest unanswered segment to a core therefore always goes,
window or not: every rank eventually sends the lowest incomplete segment, so it completes.

Sans-I/O: time and samples are passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["Congestion", "CongestionWindow", "admit", "any_admitted", "fitting_window"]

# What the kernel charges a datagram against a socket's receive buffer, per byte of it: the
# sk_buff and the pages it sits in (a 9000-byte frame in three 4 KiB pages: about 1.4x). A
# coalesced receive (UDP GRO) is one sk_buff for up to 64 KB of datagrams, charged little more
# than its bytes: on the emulated rack, 46 results of 8972 B fitted a 416 KiB buffer, 64 did not.
_CHARGE = 1.5
_CHARGE_COALESCED = 1.1


@dataclass(frozen=True)
class Congestion:
    """The window's policy; `enabled=False` keeps every core's window at its ceiling (the
    slots, or what the receive buffer holds)."""

    enabled: bool = True
    # A completer's round trip longer than this means a queue stands on the path. An absolute
    # bound, not one above the least round trip seen (TCP Vegas's): the job's first window
    # leaves in one burst, so the least round trip a rank ever sees already holds the queue
    # that burst built (on the simulated incast of tests/unit/test_congestion.py, 17 ms of a
    # 50 ms queue). Above a busy 2-core host's scheduling jitter and a worker's own window
    # serialised on its uplink (64 segments of 8.9 KB: 9 ms at 500 Mbit/s), below the 50 ms a
    # shaped link of the emulated rack queues before it drops. A rack whose switches drop
    # sooner wants it lower: its base round trip plus a share of the shallowest buffer.
    target: float = 0.025
    min_window: int = 2
    beta: float = 0.8  # the cut: window *= 1 - beta * excess / round trip ...
    max_decrease: float = 0.5  # ... but never by more than this share at once
    # A peer's mark carries no measure of the excess: a fixed cut, once per round trip.
    mark_decrease: float = 0.1

    def __post_init__(self) -> None:
        if (not self.target > 0 or self.min_window < 1 or not 0 < self.max_decrease < 1
                or not 0 < self.mark_decrease < 1):
            raise ValueError(f"congestion policy out of range: {self}")


def fitting_window(buffer_bytes: int, datagram_bytes: int, cores: int,
                   coalesced: bool = True) -> int:
    """The window per core whose results, arriving together from all `cores`, fit a receive
    buffer of `buffer_bytes` (SO_RCVBUF as the kernel reports it: what it charges), received
    `coalesced` (UDP GRO) or one datagram at a time. A host whose net.core.rmem_max caps a
    process that is not root (212992 bytes, doubled to 416 KiB, on a stock kernel) holds 43
    coalesced results of 8972 B. With 32 slots on each of two cores, a window's burst of
    results overflowed it: on the emulated rack (4 ranks, 64 MiB) the ranks resent 5-7% of
    their segments; held to 21-23 a core, at most 0.04%, as with root's buffers."""
    charge = _CHARGE_COALESCED if coalesced else _CHARGE
    return max(Congestion.min_window, int(buffer_bytes / (charge * datagram_bytes)) // cores)


class CongestionWindow:
    """Per appliance core: the window (`limit`), shared by the rounds of one rank in flight
    together, as their in-flight counts are. `ceilings` bound each core's window: its slots,
    or fewer where the worker's receive buffer holds fewer results (`fitting_window`)."""

    def __init__(self, ceilings: list[int], policy: Congestion | None = None,
                 slots: list[int] | None = None) -> None:
        self.policy = policy or Congestion()
        self.ceiling = list(ceilings)
        self.limit = list(ceilings)  # whole segments: what the gate compares with
        # The slots bound what is in flight without any gate; a window below them needs it.
        self._slots = list(ceilings if slots is None else slots)
        # Is any core's window below its slots? (the gate's fast path: if not, no gate)
        self.shrunk = any(c < s for c, s in zip(self.ceiling, self._slots, strict=True))
        cores = len(ceilings)
        self._window = [float(c) for c in ceilings]
        # A queue stands: this rank's latest delay sample was over target, or the latest
        # result a peer completed said its sample was (QUEUED); no growth meanwhile.
        self.queued = [False] * cores
        # ... by this rank's own samples alone: what its contributions carry (QUEUED). Not
        # the echo: a rank that passed on a peer's mark would have the appliance echo it
        # again, and one queue would go round the ranks as marks long after it drained.
        self.measured = [False] * cores
        self._cut_at = [-math.inf] * cores
        # The least delay sample of this receive turn and of the one before, per core.
        self._turn_at = [-math.inf] * cores
        self._least = [0.0] * cores
        self._before = [0.0] * cores
        self.samples = 0
        self.cuts = 0
        self.least = min(ceilings) if ceilings else 0  # the smallest window any core had

    def on_delay(self, e: int, rtt: float, now: float) -> None:
        """A round trip to core `e` whose result this rank's contribution completed."""
        policy = self.policy
        if not policy.enabled:
            return
        self.samples += 1
        # A queue stands when the samples of two receive turns say so: the least of them is
        # the measure. A busy host's scheduling (a worker not run for tens of ms on two cores
        # shared by nine processes) inflates every sample of the one turn after it, and
        # through the echo it would cut every rank's window; a queue inflates every turn's.
        if now != self._turn_at[e]:
            self._turn_at[e] = now
            self._before[e], self._least[e] = self._least[e], rtt
        elif rtt < self._least[e]:
            self._least[e] = rtt
        rtt = min(self._before[e], self._least[e])
        self.queued[e] = self.measured[e] = queued = rtt > policy.target
        if queued:
            share = min(policy.max_decrease, policy.beta * (rtt - policy.target) / rtt)
            self._cut(e, share, now, rtt)

    def on_mark(self, e: int, queued: bool, now: float, rtt: float) -> None:
        """A result to core `e` that a peer's contribution completed; `queued`: that peer's
        latest sample was over target (the RESULT's QUEUED flag). The peer's own window took
        its measure; this one shrinks by `mark_decrease`, once per round trip (`rtt`)."""
        policy = self.policy
        if not policy.enabled:
            return
        self.queued[e] = queued
        if queued:
            self._cut(e, policy.mark_decrease, now, rtt)

    def on_answer(self, e: int) -> None:
        """A first transmission to core `e` was answered: one segment more per round trip
        while no queue stands."""
        window = self._window[e]
        if self.queued[e] or window >= self.ceiling[e]:
            return
        # Once per answer while the window is short: only a whole segment more changes what
        # the gate sees, so `_set`'s bookkeeping runs only then (about once per round trip).
        window += 1.0 / window
        if int(window) == self.limit[e] and window < self.ceiling[e]:
            self._window[e] = window
        else:
            self._set(e, window)

    def _cut(self, e: int, share: float, now: float, rtt: float) -> None:
        """Shrink core `e`'s window by `share`, unless it was cut less than `rtt` ago: a cut's
        effect shows only a round trip later."""
        if now - self._cut_at[e] < rtt:
            return
        self._cut_at[e] = now
        self._set(e, self._window[e] * (1.0 - share))
        self.cuts += 1

    def _set(self, e: int, window: float) -> None:
        window = min(float(self.ceiling[e]), max(float(self.policy.min_window), window))
        self._window[e] = window
        self.limit[e] = limit = int(window)
        self.least = min(self.least, limit)
        self.shrunk = any(lim < s for lim, s in zip(self.limit, self._slots, strict=True))


def admit(ready: deque[int], cores: int, in_flight: list[int], limit: list[int],
          lowest: list[int]) -> deque[int]:
    """The segments of `ready` that the window lets go now, lowest first; the rest stay in
    `ready`, in order. A round's lowest unanswered segment to a core (`lowest`) always goes
    (the module's deadlock freedom). Segment k goes to core k mod `cores`."""
    room = [limit[e] - in_flight[e] for e in range(cores)]
    open_cores = sum(1 for r in room if r > 0)
    order = sorted(ready)
    ready.clear()
    go: deque[int] = deque()
    taken = 0
    for k in order:
        if not open_cores:
            break
        taken += 1
        e = k % cores
        if room[e] > 0:
            room[e] -= 1
            if not room[e]:
                open_cores -= 1
            go.append(k)
        elif k == lowest[e]:
            go.append(k)
        else:
            ready.append(k)
    # Once no core has room, only a core's lowest segment may still go: found without a
    # Python loop over all that wait (a shrunk window holds most of `ready`, every turn).
    rest = order[taken:]
    going = set(rest).intersection(lowest) if rest else None
    if going:
        go.extend(sorted(going))
        ready.extend(k for k in rest if k not in going)
    else:
        ready.extend(rest)
    return go


def any_admitted(ready: deque[int], cores: int, in_flight: list[int], limit: list[int],
                 lowest: list[int]) -> bool:
    """Would `admit` let any of `ready` go now?"""
    return any(in_flight[k % cores] < limit[k % cores] or k == lowest[k % cores] for k in ready)
