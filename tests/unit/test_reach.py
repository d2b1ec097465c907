"""A worker whose process ended without leaving (dataplane.reach, dataplane.icmpwatch): REACHes
to ranks a slot waits for that fell silent, the ICMP answers read back, and
what the ranks' peers are told. Values in, decisions out, on a simulated clock."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing import Pipe

import numpy as np
import pytest

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter
from reduction_appliance.dataplane.errors import RankEnded, RankLeft, RankSilent
from reduction_appliance.dataplane.icmpwatch import port_unreachable
from reduction_appliance.dataplane.reach import OVERDUE_BEATS, beat_interval
from reduction_appliance.dataplane.registration import EndpointInfo
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import AddJob, JobSpec, Request
from reduction_appliance.dataplane.transport import MemoryCoreTransport, MemoryNetwork, Send
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    SilentRank,
    pack_into,
    pack_silent,
    unpack,
    unpack_silent,
)
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import JobInfo
from reduction_appliance.plugin.stall import rank_verdict
from reduction_appliance.plugin.transport import MemoryWorkerTransport

from .feeding import feed
from .test_aggregator import contribute, heartbeat_of, make, spec, where
from .test_seams import CORE, GROUP, core_loop, until_ranks_0_and_1_fail

BEAT = beat_interval(5.0)  # the jobs here have the default liveness timeout, 5 s
OVERDUE = OVERDUE_BEATS * BEAT


@pytest.fixture
def arena() -> Iterator[SlotArena]:
    with SlotArena(capacity=8, max_payload=1024, rx_buffers=32) as a:
        yield a


def beat(agg: Aggregator, rank: int, now: float) -> list[Send]:
    return feed(agg, [(heartbeat_of(rank), where(rank))], now)


def named(answer: Send) -> list[SilentRank]:
    """The silent ranks a LIVENESS answer names."""
    assert unpack(bytes(answer.header)).kind is Kind.LIVENESS
    return unpack_silent(bytes(answer.payload))


def rank_2_stops(agg: Aggregator) -> None:
    """Every rank heartbeats at 0; ranks 0 and 1 contribute at 0.1 and heartbeat again an
    interval later; rank 2 says nothing more (its process was killed at 0.05)."""
    for rank in range(3):
        beat(agg, rank, 0.0)
    for rank in (0, 1):
        contribute(agg, rank, np.ones(8, np.float32), now=0.1)
        beat(agg, rank, BEAT)


def test_a_rank_whose_heartbeats_stopped_while_awaited_is_reached_once_per_interval(
        arena: SlotArena) -> None:
    agg = make(arena)
    rank_2_stops(agg)
    assert agg.reach([], OVERDUE - 0.01) == []  # late, but not yet overdue
    (probe,) = agg.reach([], OVERDUE + 0.01)
    h = unpack(bytes(probe.header))
    assert (probe.dest, h.kind, h.rank, h.job_id, h.length) == (where(2), Kind.REACH, 2, 5, 0)
    assert agg.reach([], OVERDUE + 0.02 + BEAT / 2) == []  # once per interval ...
    assert len(agg.reach([], OVERDUE + 0.02 + BEAT)) == 1  # ... while it lasts
    assert agg.counters.cells[Counter.REACH_PROBES] == 2


def test_its_closed_port_names_it_ended_at_once_to_its_waiting_peers(arena: SlotArena) -> None:
    agg = make(arena)
    rank_2_stops(agg)
    agg.reach([], 1.0)
    (answer,) = beat(agg, 0, 1.05)
    assert named(answer) == []  # silent for 1 s: within the 5 s liveness timeout
    assert agg.reach([("198.18.0.99", 4000), where(2)], 1.1) == []  # (reached at 1.0)
    (answer,) = beat(agg, 0, 1.2)
    (ended,) = named(answer)
    assert (ended.rank, ended.address, ended.closed, ended.left) == (2, where(2), True, False)
    assert ended.silent_s == pytest.approx(1.2)
    assert agg.counters.cells[Counter.RANKS_ENDED] == 1
    assert agg.stats(5, 1.2).silent == {2: pytest.approx(1.2)}  # (status shows it too)
    assert {s.dest for s in agg.reach([], 1.5)} == {where(0), where(1)}  # and told unasked
    verdict = rank_verdict([ended], 5, 5.0)
    assert type(verdict) is RankEnded and isinstance(verdict, RankSilent)
    assert str(verdict).startswith("rank 2 (198.18.0.12:9002) ended without leaving job 5: "
                                   "nothing came from it for 1.2 s, and its host answers that "
                                   "nothing listens at its endpoint any more")


def test_a_closed_rank_heard_again_or_joined_from_elsewhere_is_not_ended(
        arena: SlotArena) -> None:
    agg = make(arena)
    rank_2_stops(agg)
    agg.reach([], 1.0)
    agg.reach([where(2)], 1.1)
    beat(agg, 2, 1.15)  # a late datagram of its own: its port was open after all
    assert named(beat(agg, 0, 1.2)[0]) == []
    agg.reach([where(2)], 1.3)
    assert [s.rank for s in named(beat(agg, 0, 1.15 + OVERDUE + 0.01)[0])] == [2]
    moved = replace(spec(), endpoints=(where(0), where(1), ("198.18.0.12", 9102)))
    agg.update_job(moved, 2.0)  # restarted, it joined again from another port
    assert named(beat(agg, 0, 2.1)[0]) == []
    agg.reach([where(2)], 2.2)  # the old port's answer, late: not the rank's new one
    assert named(beat(agg, 0, 2.0 + OVERDUE + 0.1)[0]) == []


def test_a_closed_rank_nothing_waits_for_is_left_to_the_timeout(arena: SlotArena) -> None:
    """Nothing waits for rank 2: its peers may still be taking their last round's results
    (it finished its part), so it is neither reached nor named at once; the liveness timeout
    names it, as ended."""
    agg = make(arena)
    for rank in range(3):
        beat(agg, rank, 0.0)
    assert agg.reach([], 2.0) == []  # nothing waits for anyone: nobody is reached
    agg.reach([where(2)], 2.0)
    for tenth in range(5, 55, 5):  # ranks 0 and 1 heartbeat on, each interval
        beat(agg, 0, tenth / 10)
        assert named(beat(agg, 1, tenth / 10)[0]) == []
    (late,) = named(beat(agg, 0, 5.5)[0])
    assert (late.rank, late.closed) == (2, True)


def test_a_port_unreachable_ends_a_rank_only_once_its_heartbeats_are_overdue(
        arena: SlotArena) -> None:
    """One answering another core's datagram counts (the host rate-limits its answers, and a
    REACH's may be withheld), but one for a rank that heartbeats, forged or stale, ends
    nobody."""
    agg = make(arena)
    for rank in range(3):
        beat(agg, rank, 0.0)
    for rank in (0, 1):
        contribute(agg, rank, np.ones(8, np.float32), now=0.1)
    beat(agg, 2, 0.4)  # rank 2 computes on, heartbeating
    agg.reach([where(2)], 0.45)
    assert named(beat(agg, 0, 0.5)[0]) == []  # its heartbeat is 0.1 s old
    assert named(beat(agg, 1, 0.5 + OVERDUE - 0.1)[0]) == []
    (ended,) = named(beat(agg, 0, 0.4 + OVERDUE + 0.01)[0])  # it said nothing since: ended
    assert ended.closed and agg.stats(5, 1.2).ended == (2,)


def test_a_rank_that_left_is_neither_reached_nor_called_ended(arena: SlotArena) -> None:
    agg = make(arena)
    rank_2_stops(agg)
    agg.update_job(replace(spec(), departed=frozenset({2})), 0.5)
    assert agg.reach([], 1.5) == []
    (gone,) = named(beat(agg, 0, 1.6)[0])
    assert (gone.left, gone.closed) == (True, False)
    assert type(rank_verdict([gone], 5, 5.0)) is RankLeft


def test_a_core_the_heartbeats_do_not_come_to_tells_the_waiting_ranks_itself(
        arena: SlotArena) -> None:
    """Heartbeats go to a job's first core, but the segments waiting for an ended rank may all
    be on another: that core reaches the rank once it is overdue there, and tells the others
    itself, with a LIVENESS they did not ask for."""
    agg = make(arena)
    for rank in (0, 1):
        contribute(agg, rank, np.ones(8, np.float32), now=0.1)
    assert agg.reach([], OVERDUE - 0.01) == []  # (it joined at 0: nothing from it since)
    (probe,) = agg.reach([], OVERDUE + 0.01)
    assert probe.dest == where(2) and unpack(bytes(probe.header)).kind is Kind.REACH
    assert agg.reach([where(2)], OVERDUE + 0.1) == []  # (once per interval)
    told = agg.reach([], OVERDUE + 0.01 + BEAT)
    assert sorted(s.dest for s in told) == [where(0), where(1)]
    assert agg.counters.cells[Counter.JOB_NOTICES] == 2
    for notice in told:
        h = unpack(bytes(notice.header))
        assert (h.kind, h.flags) == (Kind.LIVENESS, Flags.UNASKED)
        assert notice.dest == where(h.rank)
        (ended,) = unpack_silent(bytes(notice.payload))
        assert (ended.rank, ended.closed, ended.address) == (2, True, where(2))


def test_the_ended_flag_travels_in_a_liveness_record() -> None:
    ranks = [SilentRank(2, ("198.18.0.12", 9002), 1.25, closed=True),
             SilentRank(4095, ("198.18.0.14", 9004), 6.0, left=True),
             SilentRank(7, ("198.18.0.17", 9007), 5.5)]
    assert unpack_silent(pack_silent(ranks)) == ranks


def _port_unreachable(sport: int, dest: tuple[str, int], *, icmp: tuple[int, int] = (3, 3),
                      protocol: int = 17, source: str = "198.18.0.1", options: int = 0) -> bytes:
    """An IPv4 packet carrying ICMP `icmp` (type, code) that quotes a datagram from
    `source`:`sport` to `dest` (its IP header `options` words longer)."""
    outer = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 0, 0, 0, 64, 1, 0,
                        socket.inet_aton(dest[0]), socket.inet_aton(source))
    inner = struct.pack("!BBHHHBBH4s4s", 0x45 + options, 0, 0, 0, 0, 64, protocol, 0,
                        socket.inet_aton(source), socket.inet_aton(dest[0])) + bytes(4 * options)
    return (outer + struct.pack("!BBHI", *icmp, 0, 0) + inner
            + struct.pack("!HHHH", sport, dest[1], 8, 0))


def test_a_port_unreachable_answering_our_address_names_the_closed_endpoint() -> None:
    ours = socket.inet_aton("198.18.0.1")
    assert port_unreachable(_port_unreachable(7100, ("198.18.0.12", 9002))) \
        == ("198.18.0.12", 9002)
    assert port_unreachable(_port_unreachable(7101, ("198.18.0.12", 9002), options=2),
                            ours) == ("198.18.0.12", 9002)  # (another core's port: taken)
    packet = _port_unreachable(7100, ("198.18.0.12", 9002))
    for other in (_port_unreachable(7100, ("198.18.0.12", 9002), icmp=(3, 1)),  # host unreach.
                  _port_unreachable(7100, ("198.18.0.12", 9002), icmp=(11, 0)),
                  _port_unreachable(7100, ("198.18.0.12", 9002), protocol=6),
                  packet[:-5], packet[:20], b""):  # (the ports cut off)
        assert port_unreachable(other) is None
    assert port_unreachable(_port_unreachable(7100, ("198.18.0.12", 9002), source="10.0.0.1"),
                            ours) is None  # another address of this host's


def test_the_memory_network_answers_a_datagram_to_nobody_as_the_kernel_does() -> None:
    net = MemoryNetwork()
    core = MemoryCoreTransport(net.bind(("appliance", 0)))
    worker = net.bind(("worker", 0))
    net.join(("239.255.0.1", 7100), ("worker", 0))
    worker.close()
    core.send([Send(("worker", 0), b"h", b""), Send(("239.255.0.1", 7100), b"h", b"")])
    net.advance(1.0)
    assert core.closed_ports() == [("worker", 0)]  # (a group's members are not answered for)
    assert core.closed_ports() == []
    core.close()


def test_through_the_real_loop_a_killed_rank_is_named_ended_within_two_intervals() -> None:
    """The client and the core loop on the in-memory network and its simulated clock: rank 2's
    process ends (its endpoint closes, as the kernel closes a killed process's socket) while
    ranks 0 and 1 reduce. Their round fails with RankEnded, not RankSilent a liveness timeout
    later, and the loop's own `tend` did the reaching."""
    world, cookie, job = 3, 0xBEEF, 4
    net = MemoryNetwork()
    ours, theirs = Pipe()
    loop = core_loop(net, theirs)
    ends = [(f"198.18.0.{101 + r}", 40000) for r in range(world)]
    spec = JobSpec(job, cookie, world, 4, multicast=GROUP, endpoints=tuple(ends),
                   liveness_timeout=5.0)
    assert loop.serve(Request(1, AddJob(spec))).error is None
    info = JobInfo("memory", job, "ended", world, 1024, GROUP, False, 60.0,
                   (EndpointInfo(0, *CORE, 4),), cookie=cookie, liveness_s=5.0)
    clients = [ApplianceClient([info], r, clock=net.clock, lease=False,
                               transport=MemoryWorkerTransport(net, ends[r], [GROUP]))
               for r in range(world)]
    try:
        for client in clients:
            client.heartbeat()
        clients[2].close()  # killed: no heartbeat, no contribution, no leave from now on
        tickets = [clients[r].start(np.ones(1000, np.float32)) for r in range(2)]
        failed = until_ranks_0_and_1_fail(net, loop, clients, tickets, tend_s=0.1)
        assert set(failed) == {0, 1}
        for error in failed.values():
            assert type(error) is RankEnded, error
            assert str(error).startswith("rank 2 (198.18.0.103:40000) ended without leaving")
        assert net.now <= OVERDUE + 0.1 + 2 * BEAT  # reached, answered, told at a heartbeat
        assert loop.counters[Counter.RANKS_ENDED] == 1
    finally:
        for c in clients:
            c.close()
        loop.close()
        ours.close()
        theirs.close()


def test_a_worker_takes_an_unasked_word_of_an_ended_rank_and_not_a_stale_answer() -> None:
    """A LIVENESS flagged UNASKED fails the rounds waiting, whatever heartbeat it follows; an
    unflagged one with an old heartbeat's number is an answer left in the socket: ignored."""
    net = MemoryNetwork()
    ours, theirs = Pipe()
    loop = core_loop(net, theirs)
    worker = ("198.18.0.101", 40000)
    spec = JobSpec(4, 0xBEEF, 2, 4, multicast=GROUP, endpoints=(worker, ("198.18.0.102", 40000)))
    assert loop.serve(Request(1, AddJob(spec))).error is None
    info = JobInfo("memory", 4, "unasked", 2, 1024, GROUP, False, 60.0,
                   (EndpointInfo(0, *CORE, 4),), cookie=0xBEEF, liveness_s=5.0)
    client = ApplianceClient([info], 0, clock=net.clock, lease=False,
                             transport=MemoryWorkerTransport(net, worker, [GROUP]))
    try:
        ticket = client.start(np.ones(1000, np.float32))
        for _ in range(5):
            client.heartbeat()  # (their answers: heartbeat numbers 1-5)
        ended = pack_silent([SilentRank(1, ("198.18.0.102", 40000), 1.2, closed=True)])
        for flags in (0, Flags.UNASKED):
            header = bytearray(HEADER_SIZE)
            pack_into(header, Header(Kind.LIVENESS, DType.FLOAT32, Op.SUM, flags, 4, 0, 0xBEEF,
                                     0, 0, 0, len(ended), 0, 1))
            net.transmit(CORE, worker, bytes(header) + ended)
            while loop.receive_burst():
                pass
            net.advance(net.now + 0.001)
            outcomes = client.progress(timeout=0)
            if not flags:
                assert outcomes == []  # a stale answer's verdict: not taken
        (outcome,) = outcomes
        assert outcome.ticket == ticket and type(outcome.error) is RankEnded, outcome
    finally:
        client.close()
        loop.close()
        ours.close()
        theirs.close()
