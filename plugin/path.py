"""What a rank knows of the path to each appliance core, carried from round to round: the
timing bounds of a job, the round-trip estimate and the congestion window (see session.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MIN_WINDOW", "RttEstimator", "Timing"]


@dataclass(frozen=True)
class Timing:
    rto_initial: float = 0.05  # before the first sample of a core
    rto_min: float = 0.01  # the floor: a rack's round trips are well under it
    rto_max: float = 1.0  # one segment's backed-off timer never waits longer
    deadline: float = 60.0


MIN_WINDOW = 2  # segments in flight per core: below it every loss would idle the core


@dataclass
class RttEstimator:
    """What a rank knows of the path to each destination (an endpoint index, an appliance core),
    carried from round to round: the smoothed round-trip time (RFC 6298) and the congestion
    window, the segments it may have in flight to that core (AIMD: one more per window of
    results, half on a loss, at most one cut per round trip; never above the core's slots,
    never below `MIN_WINDOW`). Until a loss is seen the window is the whole slot count, so a
    clean network runs exactly as without it; an incast that overflows a queue or a socket
    buffer shrinks it to what the path holds instead of losing a window's worth every time."""

    timing: Timing = field(default_factory=Timing)
    _srtt: dict[int, float] = field(default_factory=dict)
    _rttvar: dict[int, float] = field(default_factory=dict)
    _cwnd: dict[int, float] = field(default_factory=dict)
    _cut_at: dict[int, float] = field(default_factory=dict)
    window_cuts: int = 0

    def sample(self, dest: int, rtt: float) -> None:
        srtt = self._srtt.get(dest)
        if srtt is None:
            self._srtt[dest], self._rttvar[dest] = rtt, rtt / 2
        else:
            self._rttvar[dest] = 0.75 * self._rttvar[dest] + 0.25 * abs(srtt - rtt)
            self._srtt[dest] = 0.875 * srtt + 0.125 * rtt

    def srtt(self, dest: int) -> float | None:
        return self._srtt.get(dest)

    def rto(self, dest: int) -> float:
        t = self.timing
        srtt = self._srtt.get(dest)
        base = t.rto_initial if srtt is None else srtt + 4 * self._rttvar[dest]
        return min(t.rto_max, max(t.rto_min, base))

    def window(self, dest: int, slots: int) -> int:
        """Segments that may be in flight to `dest` now (of its `slots`)."""
        cwnd = self._cwnd.get(dest)
        return slots if cwnd is None else max(min(slots, MIN_WINDOW), min(slots, int(cwnd)))

    def on_result(self, dest: int, slots: int) -> None:
        """A segment's result came back: the window grows by one per window of results."""
        cwnd = self._cwnd.get(dest)
        if cwnd is not None and cwnd < slots:
            self._cwnd[dest] = min(float(slots), cwnd + 1 / cwnd)

    def on_loss(self, dest: int, slots: int, now: float) -> None:
        """A segment to `dest` was lost (not merely late): halve the window, once per round
        trip (the losses of one overflowing burst are one congestion event)."""
        if now - self._cut_at.get(dest, -1.0) < (self._srtt.get(dest) or self.timing.rto_min):
            return
        cwnd = self._cwnd.get(dest, float(slots))
        self._cwnd[dest] = max(float(MIN_WINDOW), cwnd / 2)
        self._cut_at[dest] = now
        self.window_cuts += 1
