"""What a worker does when a segment's retransmission timer runs out, from what the segment's
appliance core has said lately.

`CoreSigns` keeps, per core, the latest answer, result and PENDING a round heard from it, and
its stall query; `on_expiry` returns the decision as data (`Decision`), and
`plugin.session.AllreduceRound.due` applies it. Three outcomes (`Expiry`):

- RESTART: while the round is clean, a segment's timer restarts with each answer its core
  gives to an earlier segment (RFC 6298's 5.3, per core): one waiting its turn behind a late
  rank is not asked after.
- DEFER: when a whole core stalls in a clean round, one query speaks for every segment in
  flight to it; the others wait for its answer (and, their timers having run out, give no
  round-trip sample: Karn's rule): an RTO, doubled each time the query before heard only that
  the core waits for peers.
- ASK: the segment is asked after now (a QUERY, or its payload), with its next timeout. A
  stall's query says so (a PROBE): the appliance then holds back a result it has only just
  sent (dataplane.aggregator). Once the round repaired a loss, a stall may be a late rank's
  own repair, and its queries go plain, as every repair does.

A core whose latest word in a clean round is a PENDING (it has ours and waits for late ranks)
is asked less and less often, as a silent one is: a rank late by seconds (a checkpoint, a
paused process) once drew a query per segment in flight per RTO from every rank waiting for
it (one rank's 64 KiB allreduce on the rack: 780 queries a second, each answered), work for
an appliance core that other jobs share.

Sans-I/O: time is passed in.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import NamedTuple

from .rtt import Timing

__all__ = ["STALL_SHARE", "CoreSigns", "Decision", "Expiry"]

STALL_SHARE = 4  # a stall holds more than a quarter of the core's window (`on_expiry`)


class Expiry(Enum):
    """What an expired timer does."""

    RESTART = auto()  # the segment waits its turn: its timer runs again at `at`
    DEFER = auto()  # a stall query speaks for it: its timer runs again at `at`; no RTT sample
    ASK = auto()  # ask after it now; `at` is its next timeout, `probe` how to ask


class Decision(NamedTuple):
    expiry: Expiry
    at: float
    probe: bool = False


class CoreSigns:
    """The latest signs of life of each appliance core, as one round heard them."""

    def __init__(self, cores: int) -> None:
        self.heard_at = [-1.0] * cores  # latest answer of any kind
        self.progress_at = [-1.0] * cores  # latest result of a first transmission
        self.pending_at = [-1.0] * cores  # latest PENDING
        # A stalled core's one query at a time: when it left, and until when the others wait
        # for its answer.
        self._stall_query_at = [-1.0] * cores
        self._stall_until = [-1.0] * cores

    def on_expiry(self, e: int, now: float, *, stall: bool, crowded: bool, last_sent: float,
                  timeout: float, rto: float, in_flight: int, timing: Timing) -> Decision:
        """The timer of a segment to core `e` ran out at `now`. `stall`: the round has
        repaired no loss and nothing sent to the core after the segment has been answered (a
        stall, not a hole). `crowded`: the round holds more than 1/`STALL_SHARE` of the
        core's window. `last_sent`: when the segment last left; `timeout`: its last timeout;
        `rto`: the core's; `in_flight`: segments in flight to the core, every round's."""
        # However many segments wait, a core whose timers have backed off hears no more than
        # one query per `silent_query_gap` from us (and never waits longer than `rto_max`).
        cap = max(rto, min(timing.rto_max, timing.silent_query_gap * in_flight))
        if stall:
            # Its turn has not come when the core answered an earlier first transmission since
            # it left: the pipeline moves. On a clean network a late rank or a busy host stalls
            # every segment in flight at once: each one's own timer would send a query, and the
            # appliance would resend every result already on its way (at n = 8, every resent
            # result arrived as a duplicate).
            progress = self.progress_at[e]
            if progress > last_sent and now < progress + rto:
                return Decision(Expiry.RESTART, progress + rto)
            if crowded:
                # One query says why as well as all of them would (its PENDING names the late
                # ranks; the core tells those ranks too). While each such query hears a
                # PENDING, the core is waiting for peers and the next one goes alone again;
                # one that heard none (a lost result, or silence) lets every timer go, as in
                # a lossy round.
                until = self._stall_until[e]
                if now < until:
                    return Decision(Expiry.DEFER, until)
                asked = self._stall_query_at[e]
                if until < 0 or self.pending_at[e] >= asked:
                    # The last query heard that the core waits for peers, and no result came
                    # since: the next one waits twice as long (a late rank's lateness is
                    # not a path's).
                    waits = until >= 0 and self.progress_at[e] < asked
                    gap = min(cap, 2 * (until - asked)) if waits else rto
                    self._stall_query_at[e] = now
                    self._stall_until[e] = now + gap
        heard = self.heard_at[e]
        if heard >= last_sent and not (stall and self.pending_at[e] >= heard):
            # The core answered since and lacks something of ours: a random loss, not an
            # overloaded or dead core, so waiting longer would only idle the slot.
            return Decision(Expiry.ASK, rto, stall)
        # A silent core, or one whose latest word is that it waits for late ranks: ask less and
        # less often, but no less often than once per `silent_query_gap` for each segment in
        # flight to it. At a round's tail a lost answer is likelier than a dead core: at 20%
        # loss each way, a lone last segment's doubled timer (up to a second) was most of the
        # round.
        return Decision(Expiry.ASK, min(max(timeout * 2, rto), cap), stall)
