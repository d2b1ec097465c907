"""A rank of an aborted run that comes late is told why its run ended, at its join, instead of
waiting in a fresh job for peers that have gone; a restart of the run goes on (control/aborts.py,
`Registry.plan`, `Registry.join`, `Registry.withdraw_late`)."""

from __future__ import annotations

import pytest

from reduction_appliance.control.aborts import Aborted, AbortMemory
from reduction_appliance.control.registry import (
    JobGone,
    JobRequest,
    JobState,
    Registry,
    UnknownJob,
)
from tests.unit.test_registry import SECRET, at, registry

WHY = "at rank 2's request: its path to the appliance loses this job's 8972 B datagrams"
REQUEST = JobRequest("narrow", 3)


def _aborted_run(now: float = 100.0) -> tuple[Registry, int]:
    """Job 'narrow' of 3 ranks: ranks 0 and 2 joined, rank 2 aborted it at `now`."""
    reg = registry()
    plan = reg.plan(REQUEST, cookie=1, secret=SECRET, now=now - 1)
    reg.commit(plan)
    job = plan.spec.job_id
    reg.join(job, 0, SECRET, at(0))
    reg.join(job, 2, SECRET, at(2))
    assert reg.abort(job, 2, SECRET, reason=WHY, now=now).state is JobState.ABORTED
    return reg, job


def test_a_rank_registering_after_the_abort_is_told_why_at_its_join_and_its_job_withdrawn(
) -> None:
    reg, first = _aborted_run()
    # Rank 1 started late: its registration finds no job of that name, and makes one.
    late = reg.plan(REQUEST, cookie=2, secret=SECRET, now=101.0)
    reg.commit(late)
    assert late.late_for is not None and late.late_for.job_id == first
    with pytest.raises(JobGone) as told:
        reg.join(late.spec.job_id, 1, SECRET, at(1))
    said = str(told.value)
    assert said.startswith(f"rank 1 came after its run had ended: job {first} ('narrow') was "
                           f"aborted ({WHY}) before this rank joined it."), said
    assert told.value.status == 410
    assert isinstance(told.value, UnknownJob)  # (what callers that catch 404 catch)
    # Nobody joined the job it made: withdrawn with it, and a request naming it says why.
    gone = reg.withdraw_late(late.spec.job_id, now=101.0)
    assert gone is not None and gone.state is JobState.ABORTED
    assert reg.find("narrow") is None and reg.slots_in_use() == 0
    with pytest.raises(JobGone, match=f"registered after job {first} .* by a late rank"):
        reg.get(late.spec.job_id)
    # A second late rank of that run is told the same (the name still names the first abort).
    again = reg.plan(REQUEST, cookie=3, secret=SECRET, now=102.0)
    reg.commit(again)
    with pytest.raises(JobGone, match=f"job {first} .*{WHY}"):
        reg.join(again.spec.job_id, 1, SECRET, at(1))


def test_a_rank_that_registered_before_the_abort_and_joins_after_it_is_told_why() -> None:
    reg, first = _aborted_run()
    with pytest.raises(JobGone) as told:
        reg.join(first, 1, SECRET, at(1))
    assert str(told.value) == f"job {first} ('narrow') was aborted ({WHY})"
    with pytest.raises(JobGone):
        reg.leave(first, 0, SECRET)


def test_a_restart_of_the_aborted_run_goes_on() -> None:
    """A launcher restarts every rank with the same name and secret: a rank the aborted job had
    seen joins first, and from then on the job is that run's, late ranks and all."""
    reg, _ = _aborted_run()
    restarted = reg.plan(REQUEST, cookie=2, secret=SECRET, now=103.0)
    reg.commit(restarted)
    job = restarted.spec.job_id
    assert reg.join(job, 2, SECRET, at(2, 40001)).late_for is None
    reg.join(job, 1, SECRET, at(1))  # (never joined the aborted job: now it may)
    assert reg.join(job, 0, SECRET, at(0, 40001)).state is JobState.ACTIVE
    assert reg.withdraw_late(job, now=104.0) is None  # joined: it stays


@pytest.mark.parametrize("differs", ["secret", "spec", "later", "operator's abort, no clock"])
def test_only_the_same_run_shortly_after_its_abort_is_taken_for_a_late_rank(
        differs: str) -> None:
    """Another secret or spec is another run; a registration later than `jobs.deadline_s`
    after the abort (60 s here) is taken for a new run too; and an abort without the clock
    (the daemon's shutdown) is not remembered."""
    if differs == "operator's abort, no clock":
        reg = registry()
        plan = reg.plan(REQUEST, cookie=1, secret=SECRET, now=0.0)
        reg.commit(plan)
        reg.abort(plan.spec.job_id)
        with pytest.raises(UnknownJob) as told:
            reg.get(plan.spec.job_id)
        assert not isinstance(told.value, JobGone)
        now, secret, request = 1.0, SECRET, REQUEST
    else:
        reg, _ = _aborted_run(now=100.0)
        now, secret, request = {
            "secret": (101.0, "another-run's", REQUEST),
            "spec": (101.0, SECRET, JobRequest("narrow", 4)),
            "later": (160.5, SECRET, REQUEST),
        }[differs]
    fresh = reg.plan(request, cookie=2, secret=secret, now=now)
    reg.commit(fresh)
    assert fresh.late_for is None
    assert reg.join(fresh.spec.job_id, 1, secret, at(1)).state is JobState.CREATED


def test_the_memory_forgets_after_its_time_and_keeps_the_last_run_of_a_name() -> None:
    memory = AbortMemory(keep_s=10.0)

    def gone(job_id: int, at_s: float, name: str = "a") -> Aborted:
        return Aborted(job_id, JobRequest(name, 2), SECRET, frozenset({0}), "why", at_s)

    memory.remember(gone(1, 0.0))
    memory.remember(gone(2, 5.0))  # the same name again: the later run counts
    memory.remember(gone(3, 6.0, "b"), as_run=False)  # by id only
    assert memory.of_run(JobRequest("a", 2), now=9.0) == gone(2, 5.0)
    assert memory.of_run(JobRequest("b", 2), now=9.0) is None
    assert memory.of_run(JobRequest("a", 3), now=9.0) is None  # another spec: another run
    assert [memory.of_id(i) is not None for i in (1, 2, 3)] == [True, True, True]
    assert memory.of_run(JobRequest("a", 2), now=12.0) == gone(2, 5.0)
    assert memory.of_id(1) is None and len(memory) == 2  # 12 s old: forgotten
    assert memory.of_run(JobRequest("a", 2), now=15.5) is None
    assert len(memory) == 1 and memory.of_id(3) is not None  # 9.5 s old
