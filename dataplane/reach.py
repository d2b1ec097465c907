"""Finding a worker whose process ended without leaving in about a second, not a liveness timeout.

A worker killed by the OOM killer, by a crash or by a scheduler's SIGKILL says nothing, and its
peers waited for it until the liveness timeout (5 s by default) named it silent. Its host is
usually still up, though, and its socket closed with its process: a datagram sent to that port
comes back as ICMP port unreachable. So each core sends a REACH (`tend`) to each rank a slot
there waits for, once the rank is overdue there (nothing from it for `OVERDUE_BEATS` heartbeat
intervals: on the core its heartbeats come to, they stopped), and again each interval while
that lasts. It leaves from the socket the rank's own datagrams came to, so that a stateful
firewall on the worker's host lets it through as their reply. A live worker ignores it, and so
does a paused one: its port is open.

The transport watches ICMP (dataplane.icmpwatch) and gives back the endpoints found closed,
whichever core's datagram the host answered (hosts rate-limit their ICMP, one message a second
after a burst, and a REACH's answer may be the one withheld). Each rank joined from one is
marked (`refused`); once it is overdue too (`JobState.closed_ranks`), it has ended. A core that
a slot of which waits for an ended rank tells every other rank so at once, each interval while
it waits (LIVENESS flagged UNASKED: their rounds waiting for it fail with RankEnded); the core
the heartbeats come to also names it in its answers (`JobState.silent`). A rank nothing waits
for is left to the liveness timeout: its peers may still be taking their last round's results.
Where ICMP cannot be watched, or the worker's whole host is gone, the timeout decides, as
before.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from .counters import Counter
from .notices import answer, to_every_rank
from .slotstate import OVERDUE_BEATS, JobState
from .spec import Address
from .transport import Send
from .wire import (
    DType,
    Flags,
    Header,
    Kind,
    Op,
    SilentRank,
    beat_interval,
    pack_silent,
)

__all__ = ["OVERDUE_BEATS", "refused", "tend"]


def tend(job: JobState, now: float, cells: NDArray[np.uint64]) -> list[Send]:
    """Each interval, for each rank of `job` a slot here waits for and overdue here: a REACH
    to it, or, once it has ended, a LIVENESS flagged UNASKED to every other bound rank."""
    spec = job.spec
    interval = beat_interval(spec.liveness_timeout)
    overdue = job.overdue(now)
    due = [rank for rank, seen in enumerate(job.last_seen)
           if seen < overdue and job.reached.get(rank, -np.inf) <= now - interval]
    if not due:
        return []
    awaited = job.awaited()
    ended = job.closed_ranks(now) if job.closed else frozenset()
    sends: list[Send] = []
    for rank in due:
        address = job.elsewhere.get(rank) or spec.endpoints[rank]
        if address is None or rank in spec.departed or rank not in awaited:
            continue
        job.reached[rank] = now
        if rank in ended:
            ended_here = SilentRank(rank, spec.endpoints[rank], now - job.last_seen[rank],
                                    closed=True)
            told = to_every_rank(job, Kind.LIVENESS, pack_silent([ended_here]), Flags.UNASKED,
                                 skip=spec.departed | {rank})
            cells[Counter.JOB_NOTICES] += len(told)
            sends.extend(told)
            continue
        h = Header(Kind.REACH, DType.FLOAT32, Op.SUM, 0, spec.job_id, rank, spec.cookie,
                   job.rounds, 0, 0, 0, 0, spec.epoch)
        sends.append(answer(Kind.REACH, h, address, spec.epoch))
        cells[Counter.REACH_PROBES] += 1
    return sends


def refused(jobs: Iterable[JobState], addresses: Iterable[Address], now: float,
            cells: NDArray[np.uint64]) -> None:
    """The hosts behind `addresses` said nothing listens there: mark each rank joined from
    one (what that means waits for it to be overdue: `JobState.closed_ranks`)."""
    closed = set(addresses)
    for job in jobs:
        for rank, joined_from in enumerate(job.spec.endpoints):
            address = job.elsewhere.get(rank) or joined_from
            if address in closed:
                was = job.closed.get(rank)
                job.closed[rank] = (address, now)
                if was is None or was[1] < job.last_seen[rank]:  # (counted once per end)
                    cells[Counter.RANKS_ENDED] += 1
