"""Draining the jobs when the appliance stops (SIGTERM): which job may be aborted, and when.

Sans-I/O: `Drain` is handed every core's `Fences` (the reply to `FenceJobs`) and says which
jobs have drained; the caller (control.service.Appliance.shutdown) asks the cores with
`floors` and aborts what it is told. A job has drained when every core that has it fences it
at the same round (none can begin a later one), none of its segments up to there waits for a
contribution, and nothing of those rounds came for `QUIET_S`: a worker that lost a result asks
for it again within its retransmission timeout (tens of milliseconds on a rack; a timer backed
off by loss waits up to 1 s, plugin/rtt.py's `rto_max`), and a rank aborted before it had
heard every result up to the fence would fail a call its peers finished. Or, at once, when
every segment still waiting waits for a rank that cannot come (`Fenced.stuck_on`): one that
never joined, left, or ended. A rank ended is found by a core a slot of which waits for it
(`Fenced.ended`), and passed on to every core with the next `FenceJobs` (`ended`).
"""

from __future__ import annotations

from typing import NamedTuple

from reduction_appliance.dataplane.spec import Fences
from reduction_appliance.dataplane.wire import number_before

__all__ = ["QUIET_S", "Drain", "Drained", "overdue"]

QUIET_S = 1.0
_STOPPING = "the appliance is shutting down"


class Drained(NamedTuple):
    """A job that may be aborted: every round up to `fence` finished (0: none had begun), or,
    where `stuck_on` names ranks, the rounds begun wait for those, which cannot come."""

    fence: int
    stuck_on: tuple[int, ...] = ()

    def why(self) -> str:
        """What the job's workers are told (their JobAborted carries it)."""
        if self.stuck_on:
            return (f"{_STOPPING}: the rounds up to {self.fence} wait for rank(s) "
                    f"{list(self.stuck_on)}, which never joined, left, or ended (its process "
                    "gone), so none could finish")
        if self.fence:
            return (f"{_STOPPING}: it let every round up to {self.fence} finish, and no later "
                    "one begin")
        return f"{_STOPPING}: no round of the job had begun, and none may now"


def overdue(fence: int, grace_s: float) -> str:
    """What the workers of a job still draining after `grace_s` are told."""
    return (f"{_STOPPING}: the rounds up to {fence} had not finished {grace_s:g} s after it "
            "began to (a rank stopped sending)")


class Drain:
    """The jobs still draining and the fence each must at least have on every core."""

    def __init__(self, job_ids: tuple[int, ...]) -> None:
        self._floors = dict.fromkeys(job_ids, 0)
        self._ended: dict[int, set[int]] = {job_id: set() for job_id in job_ids}

    @property
    def pending(self) -> dict[int, int]:
        """Job -> the newest round any core has said it lets finish (0: none yet)."""
        return dict(self._floors)

    def floors(self) -> tuple[tuple[int, int], ...]:
        """What to send the cores (`FenceJobs.floors`)."""
        return tuple(self._floors.items())

    def ended(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """... and `FenceJobs.ended`: the ranks of each job some core found ended."""
        return tuple((job_id, tuple(sorted(ranks))) for job_id, ranks in self._ended.items()
                     if ranks and job_id in self._floors)

    def take(self, replies: list[Fences]) -> dict[int, Drained]:
        """Every answering core's `Fences`; the jobs that have drained, which are pending no
        more."""
        drained: dict[int, Drained] = {}
        for job_id, floor in list(self._floors.items()):
            views = [f for r in replies if (f := r.jobs.get(job_id)) is not None]
            if not views:  # no core has it (restarting): nothing of it can finish
                drained[job_id] = Drained(floor)
                continue
            newest = floor
            for view in views:
                self._ended[job_id].update(view.ended)
                if not newest or (view.fence and number_before(newest, view.fence)):
                    newest = view.fence
            self._floors[job_id] = newest
            if any(v.fence != newest for v in views):
                continue
            waiting = [v for v in views if v.unfinished]
            if not waiting and min(v.quiet_s for v in views) >= QUIET_S:
                drained[job_id] = Drained(newest)
            elif waiting and all(v.stuck_on for v in waiting):
                drained[job_id] = Drained(newest, tuple(sorted(
                    {rank for v in waiting for rank in v.stuck_on})))
        for job_id in drained:
            del self._floors[job_id]
        return drained
