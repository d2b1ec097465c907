"""plugin.silence: what a worker says when an appliance went silent, one of its cores says it
lacks the job, or a round timed out waiting for ranks that never joined, from what its API
answers (plain dictionaries, no network)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from reduction_appliance.dataplane.errors import (
    AllreduceTimeout,
    ApplianceSilent,
    JobAborted,
    RankSilent,
    ReductionError,
)
from reduction_appliance.dataplane.registration import EndpointInfo
from reduction_appliance.dataplane.wire import DType, Header, Kind, Op
from reduction_appliance.plugin.pipeline import Outcome
from reduction_appliance.plugin.rendezvous import JobInfo
from reduction_appliance.plugin.silence import Diagnosis, verdict

INFO = JobInfo("198.18.0.1:7070", 5, "j", 2, 8900, None, False, 60.0,
               (EndpointInfo(0, "198.18.0.1", 7000, 64), EndpointInfo(1, "198.18.0.1", 7001, 64)),
               liveness_s=5.0)
SILENT = ApplianceSilent("appliance 198.18.0.1:7070 has sent nothing for 5.0 s (liveness "
                         "timeout 5 s) while round 3 of rank 1 waited on it")


def status(heard_s: float | None, job_id: int = 5, name: str = "j") -> dict[str, object]:
    job: dict[str, object] = {"job_id": job_id, "name": name,
                              "endpoints": {"1": "198.18.0.102:40000"}}
    if heard_s is not None:
        job["heard_s"] = {"0": 0.1, "1": heard_s}
    return {"version": "0.1.0", "jobs": [job]}


def test_an_api_that_does_not_answer_either_means_the_appliance_or_the_way_to_it() -> None:
    said = verdict(INFO, 1, None, "cannot reach appliance API at 198.18.0.1:7070: refused")
    assert said == ("Its API at 198.18.0.1:7070 does not answer either (cannot reach appliance "
                    "API at 198.18.0.1:7070: refused): the appliance is down, or the network "
                    "to it")


def test_an_appliance_without_the_job_restarted_or_dropped_it() -> None:
    assert "answers but has no job 5: the appliance restarted" in verdict(INFO, 1, status(0.1, 6))
    assert "has no job 5" in verdict(INFO, 1, {"jobs": "garbled"})  # a foreign answer
    odd = {"jobs": [{"job_id": 5, "name": "j", "endpoints": [1], "seen_elsewhere": 3,
                     "heard_s": {"1": "soon"}}]}
    assert "have heard nothing from this rank (this host)" in verdict(INFO, 1, odd)
    # Restarted, it numbers jobs from 1 again: another run's job 5 is not this one.
    assert "has no job 5" in verdict(INFO, 1, status(0.1, 5, "another-run"))


def test_heard_from_this_rank_lately_means_the_way_back_drops_the_datagrams() -> None:
    said = verdict(INFO, 1, status(0.3))
    assert ("its cores hear this rank (the last datagram from 198.18.0.102:40000 0.3 s ago), "
            "but nothing they send reaches this host: a firewall here dropping UDP to "
            "198.18.0.102:40000") in said


def test_an_api_that_answered_late_and_hears_this_rank_again_means_an_outage_ended() -> None:
    """The appliance's switch port down for 7 s (liveness 5 s): the rounds failed at 5 s, the
    API's answer came once the port was back, and its cores heard this rank again. That once
    read as a firewall on this host; the late answer says the network itself was out."""
    said = verdict(INFO, 1, status(0.3), took_s=2.1)
    assert said == ("Its API at 198.18.0.1:7070 answered only after 2.1 s, and its cores hear "
                    "this rank again (the last datagram from 198.18.0.102:40000 0.3 s ago): "
                    "the network between was down for longer than the liveness timeout (5 s) "
                    "and is back (a link flap, a switch rebooting); a job outlives shorter "
                    "outages (jobs.liveness_timeout_s on the appliance sets how long). To go "
                    "on, call resync() on every rank: datagrams the outage took from every rank "
                    "leave slots that no later round could use")
    assert "a firewall here" in verdict(INFO, 1, status(0.3), took_s=0.2)  # prompt: as before


def test_not_heard_from_this_rank_means_its_datagrams_do_not_get_there() -> None:
    said = verdict(INFO, 1, status(5.4))
    assert ("its cores have heard nothing from this rank (198.18.0.102:40000) for 5.4 s: its "
            "datagrams do not reach 198.18.0.1:7000-7001 (a firewall on the appliance") in said
    # Half the liveness timeout is the line: heartbeats go out ten times per timeout.
    assert "have heard nothing" in verdict(INFO, 1, status(2.5))
    assert "have heard nothing" in verdict(INFO, 1, status(None))  # an older appliance
    one_core = replace(INFO, cores=INFO.cores[:1])
    assert "do not reach 198.18.0.1:7000 (" in verdict(one_core, 1, status(9.0))


def test_datagrams_arriving_from_elsewhere_mean_a_nat_between() -> None:
    answer = status(6.0)
    answer["jobs"][0]["seen_elsewhere"] = {"1": "10.0.0.5:32768"}  # type: ignore[index]
    said = verdict(INFO, 1, answer)
    assert ("its cores get this rank's datagrams from 10.0.0.5:32768, not from "
            "198.18.0.102:40000, where it joined: a NAT between this host and the appliance "
            "rewrites their source") in said and "docker run --network host" in said


def test_each_silent_appliance_is_asked_once_and_only_its_errors_are_explained() -> None:
    asked: list[str] = []

    def ask(info: JobInfo) -> object:
        asked.append(info.appliance)
        if info.appliance == "198.18.0.2:7070":
            raise ReductionError("cannot reach appliance API at 198.18.0.2:7070: refused")
        return status(0.2)

    other = replace(INFO, appliance="198.18.0.2:7070")
    idle = replace(INFO, appliance="198.18.0.3:7070")  # not named: not asked
    roce = replace(INFO, appliance="198.18.0.4:7070", transport="roce")
    both = ApplianceSilent(f"{SILENT}; appliance 198.18.0.2:7070 has sent nothing either; "
                           "appliance 198.18.0.4:7070 too")
    dead = RankSilent("rank 0 silent")
    outcomes = [Outcome(1, SILENT), Outcome(2, both), Outcome(3, dead), Outcome(4, None)]
    now = [100.0]
    diagnosis = Diagnosis(ask, clock=lambda: now[0])
    out = diagnosis.explained(outcomes, [INFO, other, idle, roce], 1)
    assert asked == ["198.18.0.1:7070", "198.18.0.2:7070"]
    assert [o.ticket for o in out] == [1, 2, 3, 4]
    first, second = (str(o.error) for o in out[:2])
    assert first.startswith(f"{SILENT}. Its API at 198.18.0.1:7070 answers")
    assert "Its API at 198.18.0.2:7070 does not answer either" in second
    assert type(out[0].error) is ApplianceSilent and out[2].error is dead and out[3].error is None
    # A caller retrying at once meets the standing verdict each time: the APIs are asked
    # again only once their liveness timeout has passed.
    now[0] += 4.9
    again = diagnosis.explained([Outcome(5, SILENT)], [INFO, other], 1)
    assert asked == ["198.18.0.1:7070", "198.18.0.2:7070"] and str(again[0].error) == first
    now[0] += 0.1
    diagnosis.explained([Outcome(6, SILENT)], [INFO, other], 1)
    assert asked[2:] == ["198.18.0.1:7070"]


def scripted(answers: list[object]) -> tuple[Diagnosis, list[float]]:
    """A diagnosis whose API gives the next of `answers` to each question (raising those that
    are errors), on a clock the test moves (`now[0]`)."""
    now = [100.0]

    def ask(info: JobInfo) -> object:
        answer = answers.pop(0)
        if isinstance(answer, ReductionError):
            raise answer
        return answer

    return Diagnosis(ask, clock=lambda: now[0]), now


def unknown_job(job_id: int = 5, cookie: int = 77) -> Header:
    """A core's UNKNOWN_JOB, echoing rank 1's heartbeat."""
    return Header(Kind.UNKNOWN_JOB, DType.FLOAT32, Op.SUM, 0, job_id, 1, cookie, 9, 0, 0, 0, 0, 1)


def test_a_core_that_lacks_the_job_is_believed_once_the_api_lists_none() -> None:
    """The appliance restarted without the job: its core answers the heartbeats with
    UNKNOWN_JOB, its API lists no such job and has been up for less time than this rank has
    been joined. A core being restarted lacks its jobs for a moment too, and the API then
    lists the job: no error. Each appliance is asked at most once per liveness timeout."""
    joined = replace(INFO, cookie=77)
    answers: list[object] = [{"uptime_s": 2.5, "jobs": []}]
    asked: list[str] = []

    def ask(info: JobInfo) -> object:
        asked.append(info.appliance)
        return answers[-1]

    now = [100.0]
    diagnosis = Diagnosis(ask, clock=lambda: now[0])
    gone = diagnosis.job_gone(joined, unknown_job(), 1, joined_at=90.0)
    assert type(gone) is JobAborted
    assert str(gone).startswith("the appliance at 198.18.0.1:7070 restarted 2.5 s ago, after "
                                "rank 1 joined, and lost job 5 ('j') with it; register the "
                                "job again")
    now[0] += 1.0
    assert diagnosis.job_gone(joined, unknown_job(), 1, joined_at=90.0) is None  # asked lately
    now[0] += 5.0
    answers.append(status(0.1))  # the job is there: a core restarting
    assert diagnosis.job_gone(joined, unknown_job(), 1, joined_at=90.0) is None
    assert asked == ["198.18.0.1:7070"] * 2


def test_a_job_the_appliance_forgot_is_named_so_and_strangers_notices_are_ignored() -> None:
    joined = replace(INFO, cookie=77)
    asked: list[str] = []

    def ask(info: JobInfo) -> object:
        asked.append(info.appliance)
        return {"uptime_s": 3600.0, "jobs": [{"job_id": 5, "name": "another-run"}]}

    diagnosis = Diagnosis(ask, clock=lambda: 100.0)
    # Not this job's notice (a forged cookie, another job): not even asked
    assert diagnosis.job_gone(joined, unknown_job(cookie=78), 1, joined_at=90.0) is None
    assert diagnosis.job_gone(joined, unknown_job(job_id=6), 1, joined_at=90.0) is None
    assert asked == []
    gone = diagnosis.job_gone(joined, unknown_job(), 1, joined_at=90.0)
    assert str(gone).startswith("the appliance at 198.18.0.1:7070 no longer has job 5 ('j'): "
                                "it was aborted, evicted or left, and the appliance has "
                                "forgotten it; register the job again")


def test_an_api_not_listening_yet_is_asked_again_at_the_next_heartbeat() -> None:
    """A restarted daemon's cores answer before its API listens: the first question is
    refused, and the next heartbeat's answer (a tenth of the timeout later) asks again."""
    answers: list[object] = [ReductionError("cannot reach appliance API: refused")]
    diagnosis, now = scripted(answers)
    joined = replace(INFO, cookie=77)
    assert diagnosis.job_gone(joined, unknown_job(), 1, joined_at=90.0) is None
    now[0] += 0.4
    assert diagnosis.job_gone(joined, unknown_job(), 1, joined_at=90.0) is None  # not asked
    now[0] += 0.1
    answers.append({"uptime_s": 0.3, "jobs": []})
    assert type(diagnosis.job_gone(joined, unknown_job(), 1, joined_at=90.0)) is JobAborted
    assert answers == []


TIMEOUT = AllreduceTimeout("allreduce round 1 of 64 bytes (FLOAT32, SUM) by rank 1 had no result "
                           "for its deadline, 60 s (60.0 s in all): 1 of 1 segments unanswered; "
                           "no answer from appliance 198.18.0.1:7070 core 0 (1 segment "
                           "unanswered; it still waits for ranks [2])")


def test_a_timeout_names_the_ranks_that_never_joined() -> None:
    """A job of three whose rank 2 never started (a container that failed): its peers' rounds
    time out, and the appliance's word says why, asked once per liveness timeout."""
    three = replace(INFO, world_size=3, cookie=77)
    answers = {"jobs": [{"job_id": 5, "name": "j", "joined": [0, 1], "created_s": 61.4}]}
    asked: list[str] = []

    def ask(info: JobInfo) -> object:
        asked.append(info.appliance)
        return answers

    now = [100.0]
    diagnosis = Diagnosis(ask, clock=lambda: now[0])
    (out,) = diagnosis.explained([Outcome(1, TIMEOUT)], [three], 1)
    assert type(out.error) is AllreduceTimeout
    assert str(out.error) == (f"{TIMEOUT}. The appliance at 198.18.0.1:7070 says rank 2 has "
                              "not joined job 5 ('j'), registered 61 s ago: the worker never "
                              "started there, or failed before it joined (look at that host's "
                              "launcher and log)")
    again = diagnosis.explained([Outcome(2, TIMEOUT), Outcome(3, TIMEOUT)], [three], 1)
    assert asked == ["198.18.0.1:7070"] and str(again[1].error) == str(out.error)


def test_a_timeout_with_every_rank_joined_or_no_answer_stays_as_it_was() -> None:
    three = replace(INFO, world_size=3, cookie=77)
    answers: list[object] = [
        {"jobs": [{"job_id": 5, "name": "j", "joined": [0, 1, 2], "created_s": 61.4}]},
        ReductionError("cannot reach appliance API at 198.18.0.1:7070: timed out"),
        {"jobs": [{"job_id": 5, "name": "j", "joined": "garbled"}]},
    ]
    diagnosis, now = scripted(answers)
    for _ in range(3):
        (out,) = diagnosis.explained([Outcome(1, TIMEOUT)], [three], 1)
        assert out.error is TIMEOUT
        now[0] += 5.0
    assert answers == []


def test_a_round_stalled_for_the_timeout_warns_once_of_ranks_that_never_joined(
        caplog: pytest.LogCaptureFixture) -> None:
    """An operator watching a job hang at its first allreduce learns, a liveness timeout in
    and not at the 60 s deadline, that a rank never joined; asked once, said once."""
    three = replace(INFO, world_size=3, cookie=77)
    answers: list[object] = [{"jobs": [{"job_id": 5, "name": "j", "joined": [0, 1],
                                        "created_s": 6.0}]}]
    diagnosis, _ = scripted(answers)
    with caplog.at_level(logging.WARNING):
        diagnosis.warn_missing([three], 1, stalled_s=4.0)  # not yet: the timeout is 5 s
        assert len(answers) == 1 and not caplog.records
        diagnosis.warn_missing([three], 1, stalled_s=5.2)
        diagnosis.warn_missing([three], 1, stalled_s=9.0)
    assert answers == [] and [r.getMessage() for r in caplog.records] == [
        "rank 1's allreduce has had no result for 5.2 s. The appliance at 198.18.0.1:7070 says "
        "rank 2 has not joined job 5 ('j'), registered 6 s ago: the worker never started "
        "there, or failed before it joined (look at that host's launcher and log)"]


def test_a_stall_with_every_rank_joined_asks_once_and_says_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    answers: list[object] = [{"jobs": [{"job_id": 5, "name": "j", "joined": [0, 1]}]}]
    diagnosis, _ = scripted(answers)
    with caplog.at_level(logging.WARNING):
        for stalled in (5.5, 8.0, 16.0):
            diagnosis.warn_missing([INFO], 1, stalled_s=stalled)
    assert answers == [] and not caplog.records
