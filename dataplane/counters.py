"""Per-core counters: one writer (the core's poll loop), any number of readers.

The array lives in memory the caller provides (shared memory for a data-plane process, a plain
array in tests). Readers take unsynchronised snapshots; 64-bit aligned stores cannot tear on the
platforms we run on, so a snapshot is at worst a few packets behind.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from numpy.typing import NDArray

__all__ = ["Counter", "Counters"]


class Counter(IntEnum):
    PACKETS_IN = 0
    BYTES_IN = 1
    PACKETS_OUT = 2
    BYTES_OUT = 3
    SEGMENTS_REDUCED = 4
    BYTES_REDUCED = 5
    RESULTS_RESENT = 6
    PENDING_SENT = 7
    DUPLICATES = 8
    DROP_MALFORMED = 9
    DROP_UNKNOWN_JOB = 10
    DROP_BAD_COOKIE = 11
    DROP_BAD_RANK = 12
    DROP_BAD_SLOT = 13
    DROP_BAD_LENGTH = 14
    DROP_MISMATCH = 15
    DROP_STALE = 16
    DROP_SLOT_BUSY = 17
    DROP_NO_BUFFER = 18
    DROP_TRUNCATED = 19
    ABANDONED = 20
    POLL_LOOPS = 21
    POLL_BUSY_LOOPS = 22
    SEND_ERRORS = 23
    SLOTS_IN_USE = 24
    ABORT_NOTICES = 25
    DROP_BAD_SOURCE = 26  # not from the address the rank joined from
    DROP_EPOCH = 27  # from an epoch before the job's current one (answered with RESYNC)
    DROP_WINDOW = 28  # a slot use beyond the next one: can never occupy a slot
    JOB_NOTICES = 29  # RESYNC and DIVERGED notices sent to workers, and UNASKED LIVENESS
    HEARTBEATS = 30  # HEARTBEATs from bound ranks (each answered with LIVENESS)
    QUERIES = 31  # QUERYs: a rank whose contribution is in asks for the result
    # RoCE (dataplane/roce.py): verbs calls, completions, lost peers
    ROCE_POST_SEND = 32  # send work requests posted (one per message)
    ROCE_POST_RECV = 33  # receive work requests posted (one per message received)
    ROCE_POLLS = 34  # completion-queue polls, empty ones included
    ROCE_COMPLETIONS = 35  # work completions polled
    ROCE_PEERS_LOST = 36  # queue pairs whose peer was lost (an error completion)
    ROCE_SEND_QUEUE_FULL = 37  # messages dropped: the queue pair's send queue was full
    ROCE_RESULT_WRITES = 38  # results RDMA-written into workers' landing buffers (of POST_SEND)
    ROCE_DROP_IMMEDIATE = 39  # contributions whose immediate disagreed with their slot: dropped
    ROCE_UNSENDABLE = 40  # messages that fit neither the peer's landing nor its receive buffers
    ROCE_MULTICAST_CHUNKS = 41  # UD multicast chunks of results sent (of POST_SEND)
    RESULTS_WITHHELD = 42  # queries of a result still on its way: PENDING, not the result
    # Bursts of a coalesced receive (UDP GRO) taken whole by the burst path (dataplane.runs),
    # and the datagrams of coalesced receives it left to the one-by-one path (anything unusual)
    RUNS_TAKEN = 43
    DECLINED_DATAGRAMS = 44
    # Contributions a rank's numbering showed lost (a jump), told to that rank (MISSING)
    CONTRIBUTIONS_MISSED = 45
    # PATH_PROBEs from bound ranks, each answered with a PATH_ECHO (plugin/pathprobe.py), and
    # the echoes' bytes (of BYTES_OUT: a join's cost, not a reduced byte's)
    PATH_PROBES = 46
    PATH_ECHO_BYTES = 47
    # Times every rank of a job stopped heartbeating at once for half its liveness timeout and
    # came back: the network or this core was out, not the ranks (each got a fresh timeout)
    JOB_OUTAGES = 48
    # HEARTBEATs of a job this core does not have (or with another cookie), answered with
    # UNKNOWN_JOB (dataplane.upkeep): a restarted appliance's, or a removed job's, workers
    UNKNOWN_JOB_NOTICES = 49
    # Contributions to rounds after a draining job's fence (dataplane.fence): the appliance is
    # stopping, the rounds begun finish, and a later one never starts
    DROP_FENCED = 50
    # REACHes sent to ranks whose heartbeats stopped while a slot waits for them, and ranks
    # whose host then said nothing listens at their endpoint: their process ended without
    # leaving (dataplane.reach)
    REACH_PROBES = 51
    RANKS_ENDED = 52


N_COUNTERS = len(Counter)


class Counters:
    """Named view over a uint64 array of `N_COUNTERS` cells."""

    __slots__ = ("cells",)

    def __init__(self, cells: NDArray[np.uint64] | None = None) -> None:
        self.cells: NDArray[np.uint64] = (
            np.zeros(N_COUNTERS, np.uint64) if cells is None else cells
        )
        if self.cells.shape != (N_COUNTERS,):
            raise ValueError(f"counter array must have shape ({N_COUNTERS},)")

    def __getitem__(self, c: Counter) -> int:
        return int(self.cells[c])

    def snapshot(self) -> dict[str, int]:
        return {c.name.lower(): int(self.cells[c]) for c in Counter}
