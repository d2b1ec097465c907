"""Finding a worker whose process ended without leaving in about a second, not a liveness timeout.

A worker killed by the OOM killer, by a crash or by a scheduler's SIGKILL says nothing, and its
peers waited for it until the liveness timeout (5 s by default) named it silent. Its host is
usually still up, though, and its socket closed with its process: a datagram sent to that port
comes back as ICMP port unreachable. So the core that a job's heartbeats come to sends a REACH
(`probes`) to each rank whose heartbeats stopped for `REACH_AFTER_BEATS` of their intervals
while a slot here waits for it, and again each interval while that lasts. It leaves from the
socket the rank's own datagrams came to, so that a stateful firewall on the worker's host lets
it through as their reply. A live worker ignores it, and so does a paused one: its port is open.

The transport watches ICMP (dataplane.icmpwatch) and gives back the endpoints found closed; the
rank behind one (`refused`) is then named at once in the answers to its peers' heartbeats, as a
rank whose process ended, while a slot here waits for it (`JobState.silent`). Where ICMP cannot
be watched, or the worker's whole host is gone, the liveness timeout decides, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from .counters import Counter
from .notices import answer
from .slotstate import JobState
from .spec import Address
from .transport import Send
from .wire import DType, Header, Kind, Op

__all__ = ["REACH_AFTER_BEATS", "beat_interval", "probes", "refused"]

# Heartbeats overdue by this many intervals: a lease thread late by half an interval (a busy
# host, the GIL) is common and costs one datagram; the port's answer decides, not the delay.
REACH_AFTER_BEATS = 1.5


def beat_interval(liveness_s: float) -> float:
    """How often a worker heartbeats each appliance: ten times per liveness timeout."""
    return max(0.05, liveness_s / 10)


def probes(job: JobState, now: float, cells: NDArray[np.uint64]) -> list[Send]:
    """REACH to each rank of `job` that a slot here waits for, whose heartbeats and
    datagrams stopped `REACH_AFTER_BEATS` intervals ago; none where the job's heartbeats go
    to another core (that core asks: only its answers tell the rank's peers)."""
    if job.last_beat is None:
        return []
    spec = job.spec
    interval = beat_interval(spec.liveness_timeout)
    overdue = now - REACH_AFTER_BEATS * interval
    stopped = [rank for rank, beat in enumerate(job.beats)
               if beat < overdue and job.last_seen[rank] < overdue
               and job.reached.get(rank, -np.inf) <= now - interval]
    if not stopped:
        return []
    awaited = job.awaited()
    sends = []
    for rank in stopped:
        address = job.elsewhere.get(rank) or spec.endpoints[rank]
        if address is None or rank in spec.departed or rank not in awaited:
            continue
        job.reached[rank] = now
        h = Header(Kind.REACH, DType.FLOAT32, Op.SUM, 0, spec.job_id, rank, spec.cookie,
                   job.rounds, 0, 0, 0, 0, spec.epoch)
        sends.append(answer(Kind.REACH, h, address, spec.epoch))
    cells[Counter.REACH_PROBES] += len(sends)
    return sends


def refused(jobs: Iterable[JobState], addresses: Iterable[Address], now: float,
            cells: NDArray[np.uint64]) -> None:
    """The hosts behind `addresses` said nothing listens there: mark each rank joined from one
    as ended (until it is heard again, or joins from elsewhere)."""
    closed = set(addresses)
    for job in jobs:
        for rank, joined_from in enumerate(job.spec.endpoints):
            address = job.elsewhere.get(rank) or joined_from
            if address in closed and rank not in job.closed_ranks():
                job.closed[rank] = (address, now)
                cells[Counter.RANKS_ENDED] += 1
