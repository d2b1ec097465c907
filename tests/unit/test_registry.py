"""The job lifecycle table and admission: values in, values (or named refusals) out."""

from __future__ import annotations

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.registry import (
    JobRequest,
    JobState,
    Registry,
    UnknownJob,
)
from reduction_appliance.dataplane.errors import AdmissionError, BadRequest


def registry(**jobs: object) -> Registry:
    jobs.setdefault("slots", 4)
    return Registry(parse({"dataplane": {"slot_memory_mb": 2}, "jobs": jobs}))


def admit(reg: Registry, name: str, world: int = 2, slots: int = 0, now: float = 0.0) -> int:
    plan = reg.plan(JobRequest(name, world, slots=slots), cookie=1, now=now)
    reg.commit(plan)
    return plan.spec.job_id


def test_joining_every_rank_activates_and_the_last_leave_ends_the_job() -> None:
    reg = registry()
    job = admit(reg, "a", world=2)
    assert reg.join(job, 0).state is JobState.CREATED
    assert reg.join(job, 1).state is JobState.ACTIVE
    assert reg.join(job, 1).state is JobState.ACTIVE  # a restarted worker re-joins
    assert reg.leave(job, 0).state is JobState.ACTIVE
    assert reg.leave(job, 1).state is JobState.DONE
    with pytest.raises(UnknownJob):
        reg.get(job)


def test_abort_and_illegal_transitions() -> None:
    reg = registry()
    job = admit(reg, "a")
    assert reg.abort(job).state is JobState.ABORTED
    with pytest.raises(UnknownJob):
        reg.abort(job)
    other = admit(reg, "b")
    with pytest.raises(BadRequest, match="rank 5 outside"):
        reg.join(other, 5)


def test_idle_jobs_are_evicted_from_their_last_activity() -> None:
    reg = registry(idle_timeout_s=10.0, slots=4)
    quiet = admit(reg, "quiet", now=0.0)
    busy = admit(reg, "busy", now=0.0)
    assert reg.idle({quiet: None, busy: 8.0}, now=9.0) == []
    (gone,) = reg.idle({quiet: None, busy: 8.0}, now=10.0)
    assert gone.spec.job_id == quiet and gone.state is JobState.EVICTED
    assert [p.spec.job_id for p in reg.jobs] == [busy]


def test_admission_refuses_what_does_not_fit_the_slot_budget_and_says_so() -> None:
    reg = registry(slots=8)
    capacity = reg.cfg.dataplane.slot_capacity  # 2 MiB at MTU 9000: 39 slot pairs
    assert capacity == 2 * 2**20 // (6 * 8896)
    admit(reg, "a", slots=capacity - 4)
    with pytest.raises(AdmissionError) as refused:
        admit(reg, "b", slots=8)
    text = str(refused.value)
    assert "needs 8 slot pairs" in text and "only 4 of 39 are free" in text
    admit(reg, "b", slots=4)  # what fits is admitted
