"""An appliance whose daemon ended (plugin.hearing, plugin.silence, rendezvous.api_refuses):
found overdue after one and a half heartbeats of silence while a round waits on it, asked
whether its API still listens, and, refused, named `ApplianceEnded` about a second after its
end instead of `ApplianceSilent` after the liveness timeout. Simulated time; real sockets only
for the connection that is refused."""

from __future__ import annotations

import math
import socket
from multiprocessing import Pipe

import numpy as np
import pytest

from reduction_appliance.dataplane.errors import ApplianceEnded, ApplianceSilent
from reduction_appliance.dataplane.registration import EndpointInfo
from reduction_appliance.dataplane.spec import AddJob, JobSpec, Request
from reduction_appliance.dataplane.transport import MemoryNetwork
from reduction_appliance.dataplane.wire import DType, Op, beat_interval
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.hearing import ASK_EVERY_BEATS, OVERDUE_BEATS, Hearing
from reduction_appliance.plugin.pipeline import RoundPipeline
from reduction_appliance.plugin.rendezvous import JobInfo, api_endpoint, api_refuses
from reduction_appliance.plugin.rtt import RttEstimator, Timing
from reduction_appliance.plugin.session import Endpoint
from reduction_appliance.plugin.silence import Diagnosis
from reduction_appliance.plugin.transport import MemoryWorkerTransport

from .test_seams import CORE, GROUP, core_loop

LIVENESS_S = 5.0
BEAT = beat_interval(LIVENESS_S)
OVERDUE = OVERDUE_BEATS * BEAT
EVERY = ASK_EVERY_BEATS * BEAT


def refusing(answer: bool, asked: list[tuple[str, int]], api: tuple[str, int]) -> bool:
    asked.append(api)
    return answer


def beating(hearing: Hearing, start: float, end: float) -> None:
    for k in range(round((end - start) / BEAT) + 1):
        hearing.beat(start + k * BEAT)


def test_an_appliance_is_overdue_after_one_and_a_half_beats_and_asked_about_once_per_two() -> None:
    h = Hearing(2, LIVENESS_S)
    beating(h, 0.0, 10.0)
    h.heard_at[1] = 9.0  # appliance 1 answers on; appliance 0 fell silent at 0.0
    assert h.overdue(OVERDUE - 0.01) == []
    ((appliance, quiet),) = h.overdue(OVERDUE + 0.01)
    assert appliance == 0 and quiet == pytest.approx(OVERDUE + 0.01)
    assert h.look_at == pytest.approx(OVERDUE + 0.01 + EVERY)  # not again before then
    assert h.overdue(OVERDUE + EVERY) == []
    assert [a for a, _ in h.overdue(OVERDUE + 0.01 + EVERY)] == [0]
    # Within a heartbeat of the timeout: not asked (the timeout's verdict is due).
    assert h.overdue(LIVENESS_S - BEAT + 0.01) == []
    assert h.wakeup() > LIVENESS_S - BEAT + 0.01
    # Both silent: each asked about, each once per EVERY.
    h.heard_at[:] = [18.0, 18.5]
    beating(h, 10.0, 20.0)
    found = h.overdue(19.3)
    assert [a for a, _ in found] == [0, 1] and found[1][1] == pytest.approx(0.8)
    assert h.overdue(19.3 + EVERY - 0.01) == []


def test_a_look_never_leaves_its_next_time_in_the_past() -> None:
    """Whatever `overdue` finds, `wakeup` after it is not earlier than now: a worker's loop
    that wakes for it never spins (at its instant, the next clock reading finds it)."""
    h = Hearing(3, LIVENESS_S)
    beating(h, 0.0, 20.0)
    h.heard_at[:] = [0.0, 3.0, 6.0]
    for now in np.arange(0.0, 20.0, 0.05):
        h.overdue(float(now))
        assert h.wakeup() >= now or h.wakeup() >= h.heard_at[0] + LIVENESS_S, now


def test_a_rank_back_from_a_pause_asks_about_no_one_until_its_heartbeats_go_out_again() -> None:
    h = Hearing(1, LIVENESS_S)
    beating(h, 0.0, 3.0)  # then paused until 9.0 s: no heartbeat, no answer
    assert h.overdue(9.0) == []  # back, before its lease thread beat again
    beating(h, 9.5, 12.0)  # the silence counts from its first heartbeat after the pause
    assert h.overdue(9.5 + OVERDUE - 0.01) == []
    assert [a for a, _ in h.overdue(9.5 + OVERDUE + 0.01)] == [0]


def test_without_a_liveness_timeout_nothing_is_ever_overdue() -> None:
    h = Hearing(1, math.inf)
    assert h.overdue(1e9) == [] and h.wakeup() == math.inf and h.ask_until == math.inf


def test_the_pipeline_finds_overdue_appliances_only_while_a_round_is_in_flight() -> None:
    endpoints = (Endpoint(("198.18.0.1", 7000), 1, 99, 4, "appliance 198.18.0.1:7070 core 0"),)
    p = RoundPipeline(endpoints, 0, 2, 64, RttEstimator(Timing(deadline=60.0)),
                      liveness_timeout=LIVENESS_S)
    p.beat(0.0)
    p.due(1.0)  # nothing in flight: nothing asked about
    assert p.take_overdue() == []
    p.submit(DType.FLOAT32, Op.SUM, 64)
    p.due(2.0)  # (a round's start counts as hearing it)
    p.beat(2.5)
    p.due(2.0 + OVERDUE + 0.01)
    assert [a for a, _ in p.take_overdue()] == [0]
    assert p.take_overdue() == []  # taken once


def test_a_refused_connection_ends_the_appliance_and_anything_else_does_not() -> None:
    info = JobInfo("198.18.0.1:7070", 5, "gone", 2, 1024, None, False, 60.0, (), cookie=77)
    api = ("198.18.0.1", 7070)
    asked: list[tuple[str, int]] = []
    refused = Diagnosis(lambda i: None, refuses=lambda api: refusing(True, asked, api))
    error = refused.ended(info, api, 0.8, 1)
    assert type(error) is ApplianceEnded and isinstance(error, ApplianceSilent)
    assert str(error).startswith(
        "appliance 198.18.0.1:7070 has sent nothing for 0.8 s while a round of rank 1 waited "
        "on it, and its host refuses a connection to its API: no reductiond runs there")
    assert "job 5 ('gone') went with it" in str(error) and asked == [api]
    assert refused.ended(info, None, 0.8, 1) is None  # (its name did not resolve: not asked)
    assert asked == [api]
    assert Diagnosis(lambda i: None, refuses=lambda api: False).ended(info, api, 0.8, 1) is None


def test_a_closed_port_is_refused_and_a_listening_one_is_not() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert api_refuses(("127.0.0.1", port)) is False
    assert api_refuses(("127.0.0.1", port)) is True  # (closed: the kernel answers RST)


def test_an_api_is_resolved_to_a_numeric_address_or_to_none() -> None:
    assert api_endpoint("198.18.0.1:7070") == ("198.18.0.1", 7070)
    assert api_endpoint("localhost:7070") in (("127.0.0.1", 7070), ("::1", 7070))
    for bad in ("198.18.0.1", "198.18.0.1:notaport", "memory"):  # (no name server asked)
        assert api_endpoint(bad) is None, bad


@pytest.mark.parametrize("refused", [True, False])
def test_through_the_client_a_dead_daemon_is_named_ended_within_two_beats(refused: bool) -> None:
    """Two clients and a core loop on the in-memory network: the core's process ends (the
    daemon killed with its cores) while both ranks wait for their round. Where the API refuses
    a connection, both rounds fail with ApplianceEnded by two heartbeats; where it connects
    (the daemon runs: a network outage), with ApplianceSilent at the liveness timeout, the API
    asked once per two heartbeats meanwhile. Later rounds fail at once, with the same error."""
    world, cookie, job = 2, 0xBEEF, 4
    net = MemoryNetwork()
    ours, theirs = Pipe()
    loop = core_loop(net, theirs)
    ends = [(f"198.18.0.{101 + r}", 40000) for r in range(world)]
    spec = JobSpec(job, cookie, world, 4, multicast=GROUP, endpoints=tuple(ends),
                   liveness_timeout=LIVENESS_S)
    assert loop.serve(Request(1, AddJob(spec))).error is None
    info = JobInfo("198.18.0.1:7070", job, "orphans", world, 1024, GROUP, False, 60.0,
                   (EndpointInfo(0, *CORE, 4),), cookie=cookie, liveness_s=LIVENESS_S)
    asked: list[float] = []

    def refuses(api: tuple[str, int]) -> bool:
        assert api == ("198.18.0.1", 7070)
        asked.append(net.now)
        return refused
    clients = [ApplianceClient([info], r, clock=net.clock, lease=False,
                               transport=MemoryWorkerTransport(net, ends[r], [GROUP]))
               for r in range(world)]
    for client in clients:
        client._diagnosis = Diagnosis(lambda i: None, clock=net.clock,
                                      refuses=refuses)
    try:
        for client in clients:
            client.heartbeat()
        loop.close()  # the daemon and its cores: killed
        tickets = [c.start(np.ones(1000, np.float32)) for c in clients]
        failed: dict[int, BaseException] = {}
        beat_at = 0.0
        while len(failed) < world and net.now < 30.0:
            if net.now >= beat_at:
                for client in clients:
                    client.heartbeat()
                beat_at = net.now + BEAT
            for r, client in enumerate(clients):
                for outcome in client.progress(timeout=0):
                    assert outcome.ticket == tickets[r] and outcome.error is not None
                    failed[r] = outcome.error
            net.advance(min(net.next_arrival(), beat_at))
        assert set(failed) == {0, 1}
        if refused:
            assert all(type(e) is ApplianceEnded for e in failed.values()), failed
            assert net.now <= OVERDUE + BEAT and len(asked) == world
        else:
            assert all(type(e) is ApplianceSilent for e in failed.values()), failed
            assert LIVENESS_S <= net.now <= LIVENESS_S + BEAT
            # each rank asked at 1.0 s, then each 1.0 s while silent, until a heartbeat before
            # the timeout
            assert asked == [t for t in (1.0, 2.0, 3.0, 4.0) for _ in range(world)], asked
        for client in clients:
            with pytest.raises(type(failed[0])):
                client.allreduce(np.ones(8, np.float32))
    finally:
        for client in clients:
            client.close()
        ours.close()
        theirs.close()
