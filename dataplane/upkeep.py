"""The datagrams that keep a job going besides its contributions, as data (sans-I/O): a bound
rank's HEARTBEAT, answered with the job's silent ranks (LIVENESS) or its epoch (RESYNC); a
bound rank's PATH_PROBE, echoed at the size it asks; and a HEARTBEAT of a job this core does
not have, answered with UNKNOWN_JOB within a budget.

The last is how a worker learns, at its next heartbeat, that an appliance restarted without
its job (or forgot it after it ended): until then a worker idle between calls or waiting in
one heard nothing, and only its liveness timeout, counted from the call's start, told it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from .counters import Counter
from .notices import answer
from .slotstate import JobState
from .spec import Address
from .transport import Send
from .wire import HEADER_SIZE, Header, Kind, pack_silent

__all__ = ["UNKNOWN_JOB_NOTICES_PER_S", "Budget", "heartbeat", "lacks", "path_echo",
           "unknown_job"]

# A core answers at most this many UNKNOWN_JOB notices a second. They answer datagrams whose
# sender it cannot check (no job, or not the job's cookie), so anyone could have one sent to
# any address: never larger than what came (nothing amplified), but bounded all the same. A
# worker heartbeats ten times per liveness timeout (twice a second at the default 5 s): this
# answers 500 ranks of lost jobs at once, and more within a few heartbeats each.
UNKNOWN_JOB_NOTICES_PER_S = 1000


class Budget:
    """At most `per_s` takes in each second of the caller's clock."""

    __slots__ = ("_left", "_until", "per_s")

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self._left = 0
        self._until = float("-inf")

    def take(self, now: float) -> bool:
        if now >= self._until:
            self._until, self._left = now + 1.0, self.per_s
        if self._left <= 0:
            return False
        self._left -= 1
        return True


def heartbeat(job: JobState, h: Header, source: Address, now: float,
              cells: NDArray[np.uint64]) -> Send:
    """A bound rank of `job` is alive: the answer is the job's silent ranks (LIVENESS), or
    RESYNC when the heartbeat is of another epoch."""
    half = job.spec.liveness_timeout / 2
    beat = job.last_beat
    beats = job.beats
    if beat is not None and now - beat > half and beat - beats[h.rank] <= half:
        # Every rank's heartbeats (ten per timeout each, whatever its worker does) stopped
        # at once and came back, this rank's with them: the network or this core was out,
        # not the ranks. Each rank whose heartbeats stopped with the outage gets a fresh
        # timeout, or the first answers after a flap would name as dead the ranks whose
        # heartbeats are merely still on their way. A rank silent since before keeps its
        # count, and so do all when the rank coming back fell silent long before the others
        # (its process paused, and they died meanwhile: it hears so at once, not a timeout
        # later). Its heartbeats, not its datagrams: back from a pause, its timers may send a
        # contribution before its lease thread sends a heartbeat.
        job.last_seen = [now if beat - b <= half else seen
                         for seen, b in zip(job.last_seen, beats, strict=True)]
        cells[Counter.JOB_OUTAGES] += 1
    job.last_beat = beats[h.rank] = now
    job.last_seen[h.rank] = now
    cells[Counter.HEARTBEATS] += 1
    epoch = job.spec.epoch
    if h.epoch != epoch:
        cells[Counter.JOB_NOTICES] += 1
        return answer(Kind.RESYNC, h, source, epoch)
    silent, named = job.liveness(now)
    return answer(Kind.LIVENESS, h._replace(slot=silent), source, epoch, pack_silent(named))


def path_echo(job: JobState, h: Header, received: int, source: Address, now: float,
              max_payload: int, cells: NDArray[np.uint64]) -> Send | None:
    """Echo a bound rank's PATH_PROBE (wire.py) at the size it asks: never longer than a
    segment, so it amplifies nothing; None for a probe that is not what it says."""
    job.last_seen[h.rank] = now
    if received != h.length or h.offset > max_payload:
        cells[Counter.DROP_BAD_LENGTH] += 1
        return None
    cells[Counter.PATH_PROBES] += 1
    cells[Counter.PATH_ECHO_BYTES] += HEADER_SIZE + h.offset
    return answer(Kind.PATH_ECHO, h._replace(offset=received), source, job.spec.epoch,
                  bytes(h.offset))


def lacks(jobs: Mapping[int, JobState], aborted: Mapping[int, tuple[int, object, object]],
          h: Header) -> bool:
    """Does this core lack the job `h` names: none of its number and cookie, nor one aborted
    here (whose ranks hear ABORTED instead)?"""
    job = jobs.get(h.job_id)
    if job is not None:
        return job.spec.cookie != h.cookie
    tomb = aborted.get(h.job_id)
    return tomb is None or tomb[0] != h.cookie


def unknown_job(h: Header, source: Address, now: float, budget: Budget,
                cells: NDArray[np.uint64]) -> Send | None:
    """UNKNOWN_JOB to the sender of a heartbeat of a job this core lacks, while the budget
    lasts: its header echoes the heartbeat's, cookie included."""
    if not budget.take(now):
        return None
    cells[Counter.UNKNOWN_JOB_NOTICES] += 1
    return answer(Kind.UNKNOWN_JOB, h, source, h.epoch)
