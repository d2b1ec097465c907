"""The job lifecycle table, credentials, endpoints and admission: values in, values (or named
refusals) out."""

from __future__ import annotations

import pytest

from reduction_appliance.control.config import parse
from reduction_appliance.control.registry import (
    Heard,
    JobRequest,
    JobState,
    Registry,
    UnknownJob,
)
from reduction_appliance.dataplane.errors import (
    AdmissionError,
    BadRequest,
    Conflict,
    Forbidden,
    RankHeld,
)

SECRET = "s3cret-of-the-job"


def registry(**jobs: object) -> Registry:
    jobs.setdefault("slots", 4)
    return Registry(parse({"dataplane": {"slot_memory_mb": 2, "mtu": 9000}, "jobs": jobs}))


def admit(reg: Registry, name: str, world: int = 2, slots: int = 0, now: float = 0.0,
          deterministic: bool = False) -> int:
    plan = reg.plan(JobRequest(name, world, deterministic, slots=slots), cookie=1,
                    secret=SECRET, now=now)
    reg.commit(plan)
    return plan.spec.job_id


def at(rank: int, port: int = 40000) -> tuple[str, int]:
    return (f"198.18.0.{101 + rank}", port)


def test_joining_every_rank_activates_and_the_last_leave_ends_the_job() -> None:
    reg = registry()
    job = admit(reg, "a", world=2)
    assert reg.join(job, 0, SECRET, at(0)).state is JobState.CREATED
    plan = reg.join(job, 1, SECRET, at(1))
    assert plan.state is JobState.ACTIVE and plan.spec.endpoints == (at(0), at(1))
    assert plan.spec.epoch == 1
    assert reg.leave(job, 0, SECRET).state is JobState.ACTIVE
    assert reg.leave(job, 1, SECRET).state is JobState.DONE
    with pytest.raises(UnknownJob):
        reg.get(job)


def test_a_job_ends_when_nobody_is_left_joined_though_not_every_rank_came() -> None:
    """Rank 0 joined and left before rank 1 came (it failed elsewhere): no round of the job can
    complete, and kept, the job held its name against the restarted workers' new secret for
    the idle timeout (abandonment counts joined ranks, and none was left). A registrant that
    never joined withdraws its registration the same way; a leave while another rank is still
    joined changes nothing else."""
    reg = registry()
    job = admit(reg, "a", world=3)
    reg.join(job, 0, SECRET, at(0))
    reg.join(job, 1, SECRET, at(1))
    left = reg.leave(job, 0, SECRET)
    assert left.state is JobState.CREATED  # rank 1 is still joined
    assert left.spec.departed == {0}  # the cores tell rank 1 that rank 0 left, not died
    assert reg.join(job, 0, SECRET, at(0)).spec.departed == frozenset()  # back
    reg.leave(job, 0, SECRET)
    assert reg.leave(job, 2, SECRET).spec.departed == {0}  # (never joined: a no-op)
    assert reg.leave(job, 1, SECRET).state is JobState.DONE
    with pytest.raises(UnknownJob):
        reg.get(job)
    withdrawn = admit(reg, "b", world=2)
    assert reg.leave(withdrawn, 1, SECRET).state is JobState.DONE
    assert reg.find("b") is None


def test_the_windows_ranks_hold_are_kept_while_they_are_joined() -> None:
    """What a worker says of its receive buffer as it joins (plugin/hostchecks.py) is shown
    while it is joined: replaced when it joins again, gone when it leaves."""
    reg = registry()
    job = admit(reg, "held", world=2)
    reg.join(job, 0, SECRET, at(0), window_cap=21)
    assert reg.join(job, 1, SECRET, at(1)).windows_held == {0: 21}
    assert reg.join(job, 0, SECRET, at(0, 40001), rejoin=True).windows_held == {}
    reg.join(job, 1, SECRET, at(1, 40002), rejoin=True, window_cap=9)
    assert reg.leave(job, 1, SECRET).windows_held == {}


def test_a_second_process_claiming_a_joined_rank_is_refused_naming_both() -> None:
    reg = registry()
    job = admit(reg, "a", world=2)
    reg.join(job, 1, SECRET, at(1))
    with pytest.raises(Conflict) as refused:
        reg.join(job, 1, SECRET, ("198.18.0.200", 41234))
    text = str(refused.value)
    assert "rank 1" in text and "198.18.0.102:40000" in text and "198.18.0.200:41234" in text
    assert "silent for the liveness timeout, 5 s" in text
    assert reg.get(job).spec.endpoints[1] == at(1)  # nothing moved
    with pytest.raises(RankHeld) as held:  # silent 4.9 s: maybe alive; free in 0.1 s if not
        reg.join(job, 1, SECRET, ("198.18.0.200", 41234), silent_s=4.9)
    assert held.value.retry_after_s == pytest.approx(0.1)
    assert refused.value.retry_after_s == 5.0  # (heard just now)
    # Silent for the liveness timeout: dead by the rule the other ranks go by, so a successor
    # that cannot say rejoin (a worker restarted by torchrun) takes its place, in a new epoch.
    plan = reg.join(job, 1, SECRET, ("198.18.0.200", 41234), silent_s=5.0)
    assert plan.spec.endpoints[1] == ("198.18.0.200", 41234) and plan.spec.epoch == 2


def test_ranks_that_split_the_slots_into_other_lanes_are_refused_at_the_join() -> None:
    """Rank 1 with REDUCTION_LANES=1 beside rank 0 with 2: each round waited in other slots
    for its peer until the deadline (60 s), and the timeout named a live rank as missing."""
    reg = registry()
    job = admit(reg, "a", world=2)
    reg.join(job, 0, SECRET, at(0), lanes=2)
    with pytest.raises(Conflict, match=r"rank 1 of job \d+ splits its slots into 1 lane\(s\), "
                                       r"the joined rank\(s\) \[0\] into 2"):
        reg.join(job, 1, SECRET, at(1), lanes=1)
    assert reg.join(job, 1, SECRET, at(1), lanes=2).state is JobState.ACTIVE
    # With nobody else joined, a rank sets the number afresh (its worker restarted with
    # another).
    other = admit(reg, "b", world=2)
    reg.join(other, 0, SECRET, at(0), lanes=4)
    assert reg.join(other, 0, SECRET, at(0, 40001), rejoin=True, lanes=1).lanes == 1


def test_a_restarted_rank_rejoins_from_a_new_endpoint_in_a_new_epoch() -> None:
    reg = registry()
    job = admit(reg, "a", world=2)
    reg.join(job, 0, SECRET, at(0))
    reg.join(job, 1, SECRET, at(1))
    plan = reg.join(job, 1, SECRET, at(1, port=40777), rejoin=True)
    assert plan.spec.endpoints[1] == at(1, port=40777)  # the old endpoint is retired
    assert plan.spec.epoch == 2 and plan.state is JobState.ACTIVE
    # A rank that left and comes back starts a new epoch too.
    reg.leave(job, 0, SECRET)
    assert reg.join(job, 0, SECRET, at(0)).spec.epoch == 3


def test_resync_moves_the_job_once_however_many_ranks_ask() -> None:
    reg = registry()
    job = admit(reg, "a", world=3)
    assert reg.resync(job, SECRET, seen_epoch=1).spec.epoch == 2
    assert reg.resync(job, SECRET, seen_epoch=1).spec.epoch == 2  # the others, late
    assert reg.resync(job, SECRET, seen_epoch=2).spec.epoch == 3


def test_the_secret_guards_join_leave_resync_and_registering_again() -> None:
    reg = registry()
    job = admit(reg, "a", world=2)
    for attempt in (lambda: reg.join(job, 0, "wrong", at(0)),
                    lambda: reg.leave(job, 0, "wrong"),
                    lambda: reg.resync(job, "wrong", 1),
                    lambda: reg.plan(JobRequest("a", 2), cookie=2, secret="wrong", now=0.0)):
        with pytest.raises(Forbidden, match="secret"):
            attempt()
    # Two runs given one job name meet here: the second is told so, not just "wrong secret".
    with pytest.raises(Forbidden, match="another run may have this name"):
        reg.plan(JobRequest("a", 2), cookie=2, secret="the-second-run's", now=0.0)
    # Registering the same spec without a secret finds the job, and nothing secret with it.
    found = reg.plan(JobRequest("a", 2), cookie=2, secret="", now=0.0)
    assert found.spec.job_id == job
    assert found.describe(reg.cfg).cookie is None
    assert found.describe(reg.cfg, member=True).cookie == 1


def test_abort_and_illegal_transitions() -> None:
    reg = registry()
    job = admit(reg, "a")
    assert reg.abort(job).state is JobState.ABORTED
    with pytest.raises(UnknownJob):
        reg.abort(job)
    other = admit(reg, "b")
    with pytest.raises(BadRequest, match="rank 5 outside"):
        reg.join(other, 5, SECRET, at(5))


def test_a_rank_aborts_its_job_with_the_secret_only() -> None:
    reg = registry()
    job = admit(reg, "a")
    with pytest.raises(Forbidden, match="not the join secret"):
        reg.abort(job, 1, "guessed")
    with pytest.raises(BadRequest, match="rank 2 outside world size 2"):
        reg.abort(job, 2, SECRET)
    assert reg.get(job).state is JobState.CREATED  # neither removed it
    assert reg.abort(job, 1, SECRET).state is JobState.ABORTED
    with pytest.raises(UnknownJob):
        reg.get(job)


def test_jobs_nobody_is_left_to_end_are_evicted_and_live_ones_stay() -> None:
    """Eviction goes by what the cores last heard, heartbeats included: a job of live workers
    that reduce nothing for longer than the idle timeout (an evaluation pass) stays; one never
    heard from goes after the idle timeout; one whose joined ranks are all silent for twice
    the liveness timeout (their processes exited without leaving) goes within seconds; one
    no core reported on (restarting) waits for a pass that has word of it."""
    reg = registry(idle_timeout_s=600.0, liveness_timeout_s=5.0, slots=4)
    never = admit(reg, "never", now=0.0)          # registered, nobody heard since
    pausing = admit(reg, "pausing", now=0.0)      # heartbeats, no data for 20 minutes
    crashed = admit(reg, "crashed", now=0.0)      # both ranks gone
    one_left = admit(reg, "one-left", now=0.0)    # rank 1 gone, rank 0 still heartbeats
    for job in (pausing, crashed, one_left):
        reg.join(job, 0, SECRET, at(0))
        reg.join(job, 1, SECRET, at(1))

    def heard(now: float) -> dict[int, Heard]:
        return {never: Heard(quiet_s=now), pausing: Heard(quiet_s=0.3),
                crashed: Heard(quiet_s=11.0, silent={0: 11.0, 1: 10.0}),
                one_left: Heard(quiet_s=0.2, silent={1: 900.0})}

    (gone,) = reg.idle(heard(100.0), now=100.0)
    assert gone.plan.spec.job_id == crashed and gone.plan.state is JobState.EVICTED
    assert gone.cause == "abandoned" and "every joined rank silent for 10 s" in gone.reason
    assert reg.idle({}, now=5000.0) == []  # no core answered: no word, no eviction
    (gone,) = reg.idle(heard(1200.0), now=1200.0)  # quiet since admission: the idle timeout
    assert gone.plan.spec.job_id == never and gone.cause == "idle"
    assert "no datagram from any rank for 1200 s" in gone.reason
    assert sorted(p.spec.job_id for p in reg.jobs) == [pausing, one_left]
    # Silence just under twice the timeout, or a rank not reported silent at all: not yet.
    almost = admit(reg, "almost", world=1, now=1200.0)
    reg.join(almost, 0, SECRET, at(0))
    others = heard(1210.0)
    assert reg.idle({**others, almost: Heard(quiet_s=9.9, silent={0: 9.9})}, now=1210.0) == []
    assert reg.idle({**others, almost: Heard(quiet_s=9.9)}, now=1210.0) == []
    (gone,) = reg.idle({**others, almost: Heard(quiet_s=10.0, silent={0: 10.0})}, now=1210.0)
    assert gone.plan.spec.job_id == almost


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


def test_held_buffers_are_reserved_per_deterministic_job_and_refused_beyond() -> None:
    # 128 receive buffers: 64 stay for receiving, 64 may be held, 40 per deterministic job.
    reg = Registry(parse({"dataplane": {"rx_buffers": 128},
                          "jobs": {"hold_buffers": 40, "slots": 2}}))
    first = reg.plan(JobRequest("d1", 4, deterministic=True), cookie=1, secret=SECRET, now=0)
    reg.commit(first)
    assert first.spec.hold_buffers == 40
    reg.commit(reg.plan(JobRequest("plain", 4), cookie=1, secret=SECRET, now=0))  # holds none
    with pytest.raises(AdmissionError) as refused:
        reg.plan(JobRequest("d2", 4, deterministic=True), cookie=1, secret=SECRET, now=0)
    assert "needs 40 receive buffers" in str(refused.value)
    assert "only 24 of 64 are unreserved" in str(refused.value)


def test_a_name_registered_again_with_another_spec_is_refused_naming_what_differs() -> None:
    reg = registry()
    admit(reg, "train", world=4)
    with pytest.raises(Conflict) as refused:
        reg.plan(JobRequest("train", 2, deterministic=True), cookie=2, secret=SECRET, now=0.0)
    assert str(refused.value) == (
        "job 'train' exists with world_size 4 (this request: 2), deterministic False (this "
        "request: True): every rank must register it alike; another job needs another name")


def test_a_rank_that_hears_no_multicast_turns_the_jobs_results_unicast() -> None:
    reg = registry()
    job = admit(reg, "a", world=2)
    assert reg.get(job).spec.multicast is not None
    with pytest.raises(Conflict, match="rank 1 has not joined job"):
        reg.unicast_results(job, 1, SECRET)
    reg.join(job, 0, SECRET, at(0))
    reg.join(job, 1, SECRET, at(1))
    with pytest.raises(Forbidden, match="secret"):
        reg.unicast_results(job, 1, "wrong")
    plan = reg.unicast_results(job, 1, SECRET)
    assert plan.spec.multicast is None and plan.state is JobState.ACTIVE
    assert plan.describe(reg.cfg).multicast is None  # what the ranks are told
    assert reg.unicast_results(job, 0, SECRET) == plan  # asked again (another rank): as it is
    assert plan.spec.epoch == 1  # rounds in flight go on
