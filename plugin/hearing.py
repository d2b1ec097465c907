"""When a rank last heard each appliance, and which of them have fallen silent: sans-I/O.

An appliance's cores answer every heartbeat of the lease thread (LIVENESS, ten per liveness
timeout: `wire.beat_interval`), whatever the rounds are doing, so a working appliance is heard
from at least that often. Silences are counted only while this rank's heartbeats went out
(`beat`): a process back from a pause (SIGSTOP, a debugger, a VM migrated, a swap storm) gave
its appliances nothing to answer, and counts afresh from its next heartbeat.

Two lengths of silence matter (`plugin.pipeline` applies both):

- the liveness timeout: the rounds waiting on that appliance fail with `ApplianceSilent`;
- `OVERDUE_BEATS` heartbeats: the appliance is *overdue*, and worth one cheap question, at most
  once per `ASK_EVERY_BEATS` heartbeats while it stays so: does its daemon still run?
  (`plugin.silence`: a TCP connection its API refuses says it does not). A reductiond that
  crashed or was killed takes its cores and jobs with it; its workers hear why about a second
  after, not after the timeout (as the appliance finds a killed rank: dataplane.reach).
"""

from __future__ import annotations

import math

from reduction_appliance.dataplane.wire import beat_interval

__all__ = ["ASK_EVERY_BEATS", "OVERDUE_BEATS", "Hearing"]

# As an appliance's core counts a rank overdue (dataplane.slotstate): one answer lost or late
# is no sign, a second missing one is worth a question.
OVERDUE_BEATS = 1.5
# While an appliance stays overdue and its daemon answers, the question is asked again this
# often: an outage that ends in the daemon's death is still found within about a second.
ASK_EVERY_BEATS = 2.0


class Hearing:
    """The latest datagram from each of `appliances`, and this rank's heartbeats."""

    def __init__(self, appliances: int, liveness_timeout: float) -> None:
        #: when each appliance last sent us anything (written per datagram by the pipeline)
        self.heard_at = [0.0] * appliances
        self.liveness_timeout = liveness_timeout
        finite = math.isfinite(liveness_timeout)
        beat = beat_interval(liveness_timeout) if finite else math.inf
        self.overdue_after = OVERDUE_BEATS * beat
        self.ask_every = ASK_EVERY_BEATS * beat
        # No question in the last heartbeat before the timeout: the question takes a moment
        # (plugin.silence), and the timeout's verdict is due then anyway.
        self.ask_until = liveness_timeout - beat if finite else math.inf
        # When the lease thread last sent a HEARTBEAT (None: no lease), and since when without
        # a gap of half the liveness timeout.
        self.last_beat: float | None = None
        self.beating_since = 0.0
        self._asked_at = [-math.inf] * appliances  # when each was last found overdue
        #: no appliance is overdue before this (a lower bound: what is heard only postpones it)
        self.look_at = -math.inf

    def beat(self, now: float) -> None:
        """A HEARTBEAT went out. Where none went for half the liveness timeout, this process
        was paused or starved: the appliances had nothing to answer, and silences count from
        now."""
        last = self.last_beat
        if last is None or now - last > self.liveness_timeout / 2:
            self.beating_since = now
        self.last_beat = now

    def round_starts(self, now: float) -> None:
        """An idle worker does not read its answers: every appliance gets a fresh count from the
        start of a round."""
        heard = self.heard_at
        for a, at in enumerate(heard):
            if at < now:
                heard[a] = now

    def silences(self, now: float, longer_than: float) -> bool:
        """Whether an appliance may have been silent `longer_than` seconds by `now`, counted
        while heartbeats went out (False also where this process is back from a pause: its
        silences then count from now)."""
        if now - min(self.heard_at) <= longer_than or now - self.beating_since <= longer_than:
            return False  # every appliance spoke lately: the common case, asked every turn
        last = self.last_beat
        if last is not None and now - last > self.liveness_timeout / 2:
            # No heartbeat lately: back from a pause, its lease thread not yet (nor, then, an
            # appliance's answer): count from now, as its next heartbeat will.
            self.beating_since = now
            return False
        return True

    def quiet(self, appliance: int, now: float) -> float:
        """How long `appliance` has been silent by `now`, while heartbeats went out."""
        return now - max(self.heard_at[appliance], self.beating_since)

    def wakeup(self) -> float:
        """The earliest an appliance may fall silent for the liveness timeout or become overdue
        (a lower bound: waking then may find nothing due)."""
        base = max(min(self.heard_at), self.beating_since)
        return min(base + self.liveness_timeout, max(base + self.overdue_after, self.look_at))

    def overdue(self, now: float) -> list[tuple[int, float]]:
        """The appliances to ask about now (each with how long it has been silent): silent
        for `overdue_after` but not `ask_until`, and not asked about in the last
        `ask_every`."""
        after = self.overdue_after
        if now < self.look_at:
            return []
        if not self.silences(now, after):
            self.look_at = max(min(self.heard_at), self.beating_since) + after
            return []
        found = []
        look_at = math.inf
        every, asked = self.ask_every, self._asked_at
        for a in range(len(self.heard_at)):
            quiet = self.quiet(a, now)
            if quiet >= self.ask_until:  # not before it is heard again: then `after` later
                look_at = min(look_at, now + after)
                continue
            if quiet > after and now >= asked[a] + every:
                asked[a] = now
                found.append((a, quiet))
            look_at = min(look_at, max(now - quiet + after, asked[a] + every))
        self.look_at = look_at
        return found
