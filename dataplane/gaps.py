"""A rank's contributions to a core are numbered (wire: `serial` on a first transmission), so a
core sees a lost one as a jump in the numbers and tells that rank at once (MISSING).

Without this a lost contribution is found by the other ranks: its segment's result does not
come while later ones do, and once two round trips have passed (so that a segment that is only
late is not taken for lost, see plugin/session.py) each rank sends a QUERY, which the core
answers with PENDING, and only then does the rank that lost it resend: its slot idles for four
round trips or more. On the rack (n = 4, 1 Gbit/s, 1% loss each way, four 64 MiB calls, about
1200 contributions lost) that was 5500-6300 queries and 13000-14000 PENDINGs; told by number,
1000-1800 queries and 4200-5700 PENDINGs, and a call took 620-760 ms instead of 740-900
(lossless 550-570; docs/benchmarks-journal.md).

The numbers are one byte: a jump of less than half of them is a gap, anything else a late
datagram (the network reordered it, or the rank rejoined): the number is taken as the next
one expected only when it is ahead. Sans-I/O: the notice is returned as data; the caller counts
and sends it. The one-by-one and the burst path note every first transmission's number in the
order the datagrams came (the burst path in line while they run in order, `note_sequence`
when one does not), so both leave the same sends. The last contributions before a pause show
no jump: a QUERY names its sender's newest number (wire.Flags.SENT), and `note_sent` tells the
gap up to it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .counters import Counter
from .slotstate import JobState
from .transport import Send
from .wire import HEADER_SIZE, SERIALS, DType, Header, Kind, Op, pack_into

__all__ = ["forget_sequences", "note_sent", "note_sequence"]

_AHEAD = SERIALS // 2  # a jump of fewer numbers than this is a gap; more, a late datagram


def note_sequence(job: JobState, rank: int, sequence: int, cells: NDArray[np.uint64],
                  out: list[Send]) -> None:
    """A first transmission numbered `sequence` came from `rank`: when numbers were skipped,
    tell the rank which (one MISSING listing them), and count them."""
    expected = job.next_sequence[rank]
    ahead = (sequence - expected) % SERIALS
    if ahead == 0 or expected < 0:
        job.next_sequence[rank] = (sequence + 1) % SERIALS
        return
    if ahead >= _AHEAD:
        return  # late: its place was skipped already (and told), or the rank started over
    job.next_sequence[rank] = (sequence + 1) % SERIALS
    _tell_missing(job, rank, expected, ahead, cells, out)


def note_sent(job: JobState, rank: int, newest: int, cells: NDArray[np.uint64],
              out: list[Send]) -> None:
    """A QUERY from `rank` says its newest first transmission here was numbered `newest`: when
    that and the ones before it since the last seen never came (the last contributions before
    a pause, which no later number reveals), tell the rank which."""
    expected = job.next_sequence[rank]
    if expected < 0:
        return
    gap = (newest - expected) % SERIALS  # 0: the newest itself is missing
    if gap >= _AHEAD:
        return  # seen already (newest = expected - 1), or from before a rejoin
    job.next_sequence[rank] = (newest + 1) % SERIALS
    _tell_missing(job, rank, expected, gap + 1, cells, out)


def _tell_missing(job: JobState, rank: int, first: int, count: int, cells: NDArray[np.uint64],
                  out: list[Send]) -> None:
    address = job.spec.endpoints[rank]
    if address is None:
        return
    missing = bytes((first + i) % SERIALS for i in range(count))
    cells[Counter.CONTRIBUTIONS_MISSED] += count
    job.missed_from[rank] += count
    header = bytearray(HEADER_SIZE)
    spec = job.spec
    pack_into(header, Header(Kind.MISSING, DType.FLOAT32, Op.SUM, 0, spec.job_id, rank,
                             spec.cookie, 0, 0, 0, len(missing), 0, spec.epoch))
    out.append(Send(address, header, missing))


def forget_sequences(job: JobState, rank: int | None = None) -> None:
    """Expect any number next from `rank` (every rank when None): it (re)joined, or the job
    started a new epoch."""
    if rank is None:
        job.next_sequence = [-1] * job.spec.world_size
    else:
        job.next_sequence[rank] = -1
