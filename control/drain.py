"""Draining the jobs when the appliance stops (SIGTERM): which job may be aborted, and when.

Sans-I/O: `Drain` is handed every core's `Fences` (the reply to `FenceJobs`) and says which
jobs have drained; the caller (control.service.Appliance.shutdown) asks the cores with
`floors` and aborts what it is told. A job has drained when every core that has it fences it
at the same round (none can begin a later one), none of its segments up to there waits for a
contribution, and nothing of those rounds came for `QUIET_S`: a worker that lost a result asks
for it again within its retransmission timeout (tens of milliseconds on a rack; a timer backed
off by loss waits up to 1 s, plugin/rtt.py's `rto_max`), and a rank aborted before it had
heard every result up to the fence would fail a call its peers finished.
"""

from __future__ import annotations

from reduction_appliance.dataplane.spec import Fences
from reduction_appliance.dataplane.wire import number_before

__all__ = ["QUIET_S", "Drain"]

QUIET_S = 1.0


class Drain:
    """The jobs still draining and the fence each must at least have on every core."""

    def __init__(self, job_ids: tuple[int, ...]) -> None:
        self._floors = dict.fromkeys(job_ids, 0)

    @property
    def pending(self) -> dict[int, int]:
        """Job -> the newest round any core has said it lets finish (0: none yet)."""
        return dict(self._floors)

    def floors(self) -> tuple[tuple[int, int], ...]:
        """What to send the cores (`FenceJobs.floors`)."""
        return tuple(self._floors.items())

    def take(self, replies: list[Fences]) -> dict[int, int]:
        """Every answering core's `Fences`; the jobs that have drained (job -> the round
        they finished at), which are pending no more."""
        drained: dict[int, int] = {}
        for job_id, floor in list(self._floors.items()):
            views = [f for r in replies if (f := r.jobs.get(job_id)) is not None]
            if not views:  # no core has it (restarting): nothing of it can finish
                drained[job_id] = floor
                continue
            newest = floor
            for view in views:
                if not newest or (view.fence and number_before(newest, view.fence)):
                    newest = view.fence
            self._floors[job_id] = newest
            if (all(v.fence == newest for v in views) and not any(v.unfinished for v in views)
                    and min(v.quiet_s for v in views) >= QUIET_S):
                drained[job_id] = newest
        for job_id in drained:
            del self._floors[job_id]
        return drained
