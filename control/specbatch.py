"""Changes of a job decided one at a time, carried to the cores in batches (a group commit).

A join or a leave changes one rank of a job's spec, and the cores learn it from the whole spec
(every rank's endpoint: `Supervisor.update_job`), pickled, sent to each core and compared there
rank by rank. Sent once per change, a job of n ranks starting (or ending) together cost the
appliance O(n) per rank, O(n^2) in all: at 4096 ranks most joins gave up, and leaves too
(benchmarks-journal.md, "Joins and leaves in batches"). Deciding a change takes microseconds;
so each is decided under the appliance's lock as before, and then waits until the cores have a
spec that includes it. The first waiter to get its turn sends the job's spec as it is then,
with every change decided meanwhile, and the others find theirs sent.

Bookkeeping only: the caller holds its own lock around `decided`, `pending` and `sent`, and
`await_sent` takes that lock itself, after the turn (never the other way round: no deadlock).
The sender takes the job as it is under that lock, and pushes it to the cores without it: the
changes decided during a push (at 4096 ranks on a busy appliance, 5-60 ms) go in the next one.
Pushes keep the order their jobs were taken in through a second lock, `to_cores`, which the
sender takes before it lets go of the first, as every other update of the cores must (after the
first lock, never before it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["SpecBatches"]

P = TypeVar("P")


@dataclass
class _Job(Generic[P]):
    waiting: int = 0  # calls that hold a ticket and have not had their plan yet
    decided: int = 0  # changes decided, counted (a change's ticket is the count after it)
    sent: int = 0  # the count the cores' spec includes
    plan: P | None = None  # the plan the cores got last


class SpecBatches(Generic[P]):
    """Tickets per job: `decided` issues one for a change, `pending` one for a call that
    changed nothing but must not answer before the cores have the changes made before it;
    `sent` records the plan the cores took, covering every ticket so far; `await_sent`
    returns the plan that covers a ticket, sending the latest itself when none does yet."""

    def __init__(self, lock: threading.Lock, to_cores: threading.Lock) -> None:
        self._lock = lock
        self._to_cores = to_cores
        self._turn = threading.Lock()  # one sender at a time; the rest queue up behind it
        self._jobs: dict[int, _Job[P]] = {}

    def decided(self, job_id: int) -> int:
        """A change of `job_id` was decided (the lock held): its ticket."""
        job = self._jobs.setdefault(job_id, _Job())
        job.waiting += 1
        job.decided += 1
        return job.decided

    def pending(self, job_id: int) -> int | None:
        """A call that changed nothing (the lock held): the ticket of the last change the
        cores may not have yet (a resync that found the epoch moved by another rank's, whose
        update is still on its way), or None when they have every change."""
        job = self._jobs.get(job_id)
        if job is None or job.sent >= job.decided:
            return None
        job.waiting += 1
        return job.decided

    def sent(self, job_id: int, plan: P) -> None:
        """The cores took `plan`, the job as it is now (the lock held, and `to_cores` for the
        push): every change decided so far is in it, whoever sent it (an update outside these
        batches counts too)."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.sent, job.plan = job.decided, plan

    def await_sent(self, job_id: int, ticket: int, latest: Callable[[], P],
                   push: Callable[[P], object]) -> P:
        """The plan the cores got that includes change `ticket`. Where none does yet, this
        thread takes the job as it is now (`latest`, called with the lock held) and `push`es
        it to the cores (called with `to_cores` held, the lock not). Their errors (the job is
        gone; a core refused) are this call's, and the next waiter tries in its turn."""
        with self._turn:
            try:
                with self._lock:
                    job = self._jobs[job_id]
                    if job.sent >= ticket:
                        assert job.plan is not None
                        return job.plan
                    plan, covers = latest(), job.decided
                    self._to_cores.acquire()  # before the lock goes: no older job overtakes
                try:
                    push(plan)
                finally:
                    self._to_cores.release()
                with self._lock:
                    if covers > job.sent:  # (an update outside the batches may be newer)
                        job.sent, job.plan = covers, plan
                return plan
            finally:
                with self._lock:
                    self._answered(job_id)

    def _answered(self, job_id: int) -> None:
        """A ticket holder of `job_id` is done (the lock held); nothing is kept for a job no
        call waits on."""
        job = self._jobs[job_id]
        job.waiting -= 1
        if not job.waiting:
            del self._jobs[job_id]
