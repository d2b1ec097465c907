"""Draining a job when the appliance stops: the rounds begun finish, and no later one starts.

Aborting a busy job at once (or after a wait, mid-round) leaves each rank's tensor with some
segments summed and the rest its own input, and ranks may disagree on which call was the last
to finish. A fence instead: the control plane asks every core for the newest round begun there
(`raise_fence`, floor 0), then raises every core's fence to the newest of those (a second
pass: a core may begin a round between its answer and another's; after its own fence it
begins none later). Contributions to rounds after the fence are dropped (`DROP_FENCED`), so
the next call of every rank waits, with nothing of it summed. Once the rounds up to the fence
have finished on every core and nothing of them has come for a moment (a worker that lost a
result asks again within its retransmission timeout), the control plane aborts the job: every
rank then has every round up to the fence, and fails the next before any of its results
reached its tensor (control.service.Appliance.shutdown). Where every segment still waiting
waits for a rank that cannot come (it never joined, left, or its process ended: a core found
its port closed, dataplane.reach), the job is aborted at once, saying which.

The burst path leaves a fenced job's datagrams to the one-by-one path (dataplane.runs), which
calls `fenced_out` for each contribution and query: only a draining job pays for the check.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .counters import Counter
from .slotstate import CopyState, JobState, SlotCopy
from .spec import Fenced
from .wire import number_before

__all__ = ["fenced_out", "newest_begun", "raise_fence"]


def _newer(a: int, b: int) -> int:
    """The newer of two round numbers (0: none)."""
    if not a:
        return b
    if not b:
        return a
    return b if number_before(a, b) else a


def newest_begun(job: JobState) -> int:
    """The newest round a segment of which has begun on this core, this epoch (0: none)."""
    newest = 0
    for slot in job.slots:
        for copy in slot.copies:
            if copy.state is not CopyState.EMPTY and copy.round > 0:
                newest = _newer(newest, copy.round)
    return newest


def raise_fence(job: JobState, floor: int, now: float,
                ended: frozenset[int] = frozenset()) -> Fenced:
    """Fence the job at the newest of: the newest round begun here, its fence so far, and
    `floor` (what another core has begun); say how far the rounds up to it are. `ended`: the
    job's ranks other cores found ended."""
    if job.fence is None:
        # Quiet counts from the job's last contribution: an idle job drains at once.
        job.fence_heard = job.last_activity if job.last_activity is not None else float("-inf")
    job.fence = _newer(_newer(newest_begun(job), job.fence or 0), floor)
    filling = [copy for slot in job.slots for copy in slot.copies
               if copy.state is CopyState.FILLING]
    found = job.closed_ranks(now) if job.closed else frozenset()
    return Fenced(job.fence, len(filling), now - job.fence_heard,
                  _stuck_on(job, filling, ended | found), tuple(sorted(found)))


def _stuck_on(job: JobState, filling: list[SlotCopy], ended: frozenset[int]) -> tuple[int, ...]:
    """The ranks the filling segments wait for that cannot come (not joined, or left: what
    the control plane says, alike on every core; or `ended`: found so by a core, and passed
    on to every core), where every one of them waits for one; else (). (Not a rank silent
    here: heartbeats go to one core, and the others hear a rank only while it reduces.)"""
    spec = job.spec
    cannot = {rank for rank, at in enumerate(spec.endpoints) if at is None} | spec.departed \
        | ended
    lacking: set[int] = set()
    for copy in filling:
        missing = {rank for rank in cannot if not copy.arrived >> rank & 1}
        if not missing:
            return ()  # this one can still finish
        lacking |= missing
    return tuple(sorted(lacking))


def fenced_out(job: JobState, round_no: int, now: float, cells: NDArray[np.uint64]) -> bool:
    """For a draining job (`job.fence` set): is a contribution or query of round `round_no`
    past the fence (dropped, counted)? One up to the fence is noted as heard."""
    fence = job.fence
    if not fence or number_before(fence, round_no):
        cells[Counter.DROP_FENCED] += 1
        return True
    job.fence_heard = now
    return False
