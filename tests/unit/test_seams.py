"""The transport seams and the core contract, in memory: the real client and the real core loop
on `MemoryNetwork` with a simulated clock, and a core's typed answers to its control plane."""

from __future__ import annotations

from dataclasses import replace
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import numpy as np
import pytest

from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.errors import (
    AdmissionError,
    CoreFailure,
    RankSilent,
    ReductionError,
)
from reduction_appliance.dataplane.loop import CoreLoop
from reduction_appliance.dataplane.registration import EndpointInfo
from reduction_appliance.dataplane.spec import (
    AddJob,
    Command,
    CoreConfig,
    CoreStats,
    JobSpec,
    QueryStats,
    Request,
    UpdateJob,
)
from reduction_appliance.dataplane.transport import MemoryCoreTransport, MemoryNetwork
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import JobInfo
from reduction_appliance.plugin.rtt import Timing
from reduction_appliance.plugin.transport import MemoryWorkerTransport

GROUP = ("239.255.0.1", 7100)
CORE = ("198.18.0.1", 7000)


def core_loop(net: MemoryNetwork, mailbox: Connection) -> CoreLoop:
    cfg = CoreConfig(index=0, cpu=None, bind=CORE, max_payload=1024, slot_capacity=16,
                     rx_buffers=64, kernels="numpy")
    return CoreLoop(cfg, mailbox, Counters(), MemoryCoreTransport(net.bind(CORE)),
                    clock=net.clock)


def until_ranks_0_and_1_fail(net: MemoryNetwork, loop: CoreLoop, clients: list[ApplianceClient],
                             tickets: list[int], *, tend_s: float | None = None
                             ) -> dict[int, BaseException]:
    """Ranks 0 and 1 heartbeat every 0.5 s (their lease threads' job, ten times per 5 s
    timeout) and drive their rounds `tickets`, and the core takes in what comes (and tends
    every `tend_s`, where given), until both rounds failed or the simulated clock reached
    30 s. Each rank's error."""
    failed: dict[int, BaseException] = {}
    beat_at = tend_at = 0.0
    while len(failed) < 2 and net.now < 30.0:
        if net.now >= beat_at:
            for r in range(2):
                clients[r].heartbeat()
            beat_at = net.now + 0.5
        if tend_s is not None and net.now >= tend_at:  # the loop's, between bursts
            loop.tend(net.now)
            tend_at = net.now + tend_s
        for r in range(2):
            for outcome in clients[r].progress(timeout=0):
                assert outcome.ticket == tickets[r] and outcome.error is not None
                failed[r] = outcome.error
        while loop.receive_burst():
            pass
        net.advance(min(net.next_arrival(), beat_at,
                        tend_at if tend_s is not None else float("inf")))
    return failed


class Unknown(Command[None]):
    """A command no core knows."""


def test_a_core_answers_refusals_and_unknown_commands_with_typed_errors() -> None:
    ours, theirs = Pipe()
    net = MemoryNetwork()
    loop = core_loop(net, theirs)
    try:
        spec = JobSpec(3, 99, 2, 4)
        assert loop.serve(Request(1, AddJob(spec))).error is None
        refused = loop.serve(Request(2, AddJob(spec)))  # the same job twice: a refusal
        assert refused.id == 2 and refused.error is not None
        err = refused.error.exception(core=0)
        assert isinstance(err, AdmissionError) and "already exists" in str(err)
        unknown = loop.serve(Request(3, Unknown()))
        assert unknown.error is not None
        failure = unknown.error.exception(core=0)
        assert isinstance(failure, CoreFailure)  # our bug, never the caller's 4xx
        assert "TypeError" in str(failure) and "Unknown" in str(failure)
        stats = loop.serve(Request(4, QueryStats((3, 4))))
        assert isinstance(stats.value, CoreStats) and stats.value.jobs[4] is None
        # The core still serves after both errors: the mailbox path end to end.
        ours.send(Request(5, QueryStats((3,))))
        loop.drain_mailbox()
        reply = ours.recv()
        assert reply.id == 5 and isinstance(reply.value, CoreStats)
    finally:
        loop.close()
        ours.close()
        theirs.close()


@pytest.mark.parametrize("multicast", [True, False])
def test_client_and_core_loop_over_the_in_memory_seams(multicast: bool) -> None:
    world, cookie, job = 3, 0xBEEF, 3
    net = MemoryNetwork()
    ours, theirs = Pipe()
    loop = core_loop(net, theirs)
    spec = JobSpec(job, cookie, world, 4, multicast=GROUP if multicast else None,
                   endpoints=tuple((f"198.18.0.{101 + r}", 40000) for r in range(world)))
    assert loop.serve(Request(1, AddJob(spec))).error is None
    info = JobInfo("memory", job, "seams", world, 1024, GROUP if multicast else None, False,
                   30.0, (EndpointInfo(0, *CORE, 4),), cookie=cookie)
    clients = [
        ApplianceClient([info], r, timing=Timing(0.01, 0.002, 0.2, 30.0), clock=net.clock,
                        transport=MemoryWorkerTransport(
                            net, (f"198.18.0.{101 + r}", 40000), [GROUP] if multicast else []),
                        lease=False)
        for r in range(world)
    ]
    try:
        arrays = [np.full(5000, r + 1, np.float32) for r in range(world)]
        rounds = [c.start(a, "sum") for c, a in zip(clients, arrays, strict=True)]
        done: set[int] = set()
        while len(done) < world:
            for r, c in enumerate(clients):
                for outcome in c.progress(timeout=0):
                    assert outcome.error is None and outcome.ticket == rounds[r]
                    done.add(r)
            while loop.receive_burst():
                pass
            wake = min(c.pipeline.wakeup() for c in clients)
            net.advance(min(wake, net.next_arrival(), net.now + 1.0))
        for a in arrays:
            assert np.array_equal(a, np.full(5000, 6, np.float32))
        segments = -(-5000 * 4 // 1024)
        assert loop.counters[Counter.SEGMENTS_REDUCED] == segments
        assert loop.counters[Counter.PACKETS_IN] == world * segments
        # Multicast: one result per segment; unicast fan-out: one per worker.
        assert loop.counters[Counter.PACKETS_OUT] == segments * (1 if multicast else world)
    finally:
        for c in clients:
            c.close()
        loop.close()
        ours.close()
        theirs.close()


def test_a_dead_rank_is_named_to_the_others_within_the_liveness_timeout() -> None:
    """Heartbeats through the real loop on simulated time: rank 2 stops (its process is gone),
    ranks 0 and 1 keep heartbeating; their round fails with RankSilent naming rank 2 and its
    endpoint, once rank 2 has been silent for the job's liveness timeout."""
    world, cookie, job = 3, 0xBEEF, 4
    net = MemoryNetwork()
    ours, theirs = Pipe()
    loop = core_loop(net, theirs)
    where = [(f"198.18.0.{101 + r}", 40000) for r in range(world)]
    spec = JobSpec(job, cookie, world, 4, multicast=GROUP, endpoints=tuple(where),
                   liveness_timeout=5.0)
    assert loop.serve(Request(1, AddJob(spec))).error is None
    info = JobInfo("memory", job, "liveness", world, 1024, GROUP, False, 60.0,
                   (EndpointInfo(0, *CORE, 4),), cookie=cookie, liveness_s=5.0)
    clients = [ApplianceClient([info], r, clock=net.clock, lease=False,
                               transport=MemoryWorkerTransport(net, where[r], [GROUP]))
               for r in range(world)]
    try:
        clients[2].close()  # rank 2 is gone: no heartbeat, no contribution from now on
        tickets = [clients[r].start(np.ones(1000, np.float32)) for r in range(2)]
        failed = until_ranks_0_and_1_fail(net, loop, clients, tickets)
        assert set(failed) == {0, 1}
        for error in failed.values():
            assert isinstance(error, RankSilent)
            assert "rank 2 (198.18.0.103:40000)" in str(error), error
        assert 5.0 < net.now < 6.0 + 0.5  # named within the timeout and one heartbeat

        # Rank 2's successor joins from a new endpoint (the registry moves the job to epoch 2
        # and tells the core, which tells every bound worker). Ranks 0 and 1 sit idle
        # meanwhile, heartbeating: what the core answers waits unread in their sockets, a
        # verdict naming rank 2 first. Their next round reads it all before it starts (it
        # once failed at once with RankSilent, the stale verdict held).
        where[2] = ("198.18.0.113", 40001)
        moved = JobSpec(job, cookie, world, 4, multicast=GROUP, endpoints=tuple(where),
                        liveness_timeout=5.0, epoch=2)
        for r in range(2):
            clients[r].heartbeat()
        assert loop.serve(Request(2, UpdateJob(moved))).error is None
        clients[2] = ApplianceClient([replace(info, epoch=2)], 2, clock=net.clock,
                                     lease=False,
                                     transport=MemoryWorkerTransport(net, where[2], [GROUP]))
        for r in range(2):
            clients[r].heartbeat()
        while loop.receive_burst():
            pass
        net.advance(net.now + 1.0)  # idle ranks: nothing read
        arrays = [np.full(1000, r + 1, np.float32) for r in range(world)]
        tickets = [c.start(a) for c, a in zip(clients, arrays, strict=True)]
        done: dict[int, BaseException | None] = {}
        while len(done) < world and net.now < 40.0:
            for r, c in enumerate(clients):
                for outcome in c.progress(timeout=0):
                    assert outcome.ticket == tickets[r]
                    done[r] = outcome.error
            while loop.receive_burst():
                pass
            net.advance(min(net.next_arrival(), net.now + 0.5))
        assert done == {0: None, 1: None, 2: None}
        for a in arrays:
            assert np.array_equal(a, np.full(1000, 6, np.float32))
    finally:
        for c in clients:
            c.close()
        loop.close()
        ours.close()
        theirs.close()


@pytest.mark.parametrize(("targets", "want"), [((0.02,), 0.02), ((0.03, 0.01), 0.01),
                                                ((0.0,), None), ((0.02, 0.0), None)])
def test_a_client_takes_the_least_congestion_target_its_appliances_advise(
        targets: tuple[float, ...], want: float | None) -> None:
    net = MemoryNetwork()
    infos = [JobInfo(f"memory{a}", 4, "advised", 1, 1024, GROUP, False, 60.0,
                     (EndpointInfo(0, *CORE, 4),), cookie=0xBEEF, queue_target_s=target)
             for a, target in enumerate(targets)]
    with ApplianceClient(infos, 0, clock=net.clock, lease=False,
                         transport=MemoryWorkerTransport(net, ("198.18.0.101", 40000),
                                                         [GROUP])) as client:
        window = client.pipeline.window
        assert (None if window is None else window.policy.target) == want
        if window is not None:
            assert window.limit == [4] * len(targets)  # whole: each core's slots


def test_a_client_refuses_arrays_it_cannot_reduce_and_sends_nothing_for_an_empty_one() -> None:
    """Read-only arrays (once an endless recursion: a contiguous copy of one is the array
    itself) and dtypes the appliance does not reduce are the caller's error, raised at once:
    nothing leaves, no round starts. An empty array needs no round either."""
    net = MemoryNetwork()
    info = JobInfo("memory", 5, "refusals", 1, 1024, GROUP, False, 60.0,
                   (EndpointInfo(0, *CORE, 4),), cookie=0xBEEF)
    transport = MemoryWorkerTransport(net, ("198.18.0.101", 40000), [GROUP])
    with ApplianceClient([info], 0, clock=net.clock, lease=False, transport=transport) as client:
        frozen = np.ones(64, np.float32)
        frozen.flags.writeable = False
        for array in (frozen, frozen[::2], np.frombuffer(bytes(256), np.float32),
                      np.broadcast_to(np.float32(1), (64,))):
            with pytest.raises(ReductionError, match="read-only"):
                client.allreduce(array)
        with pytest.raises(ReductionError, match="not int32"):
            client.allreduce(np.zeros((8, 8), np.int32).T)  # strided: refused before the copy
        # Not an array at all, or not an op (an AttributeError each once):
        for thing, kind in (([1.0, 2.0], "not list"), (np.float32(3), "not float32 .*scalar")):
            with pytest.raises(ReductionError, match=kind):
                client.allreduce(thing)  # type: ignore[arg-type]
            with pytest.raises(ReductionError, match=kind):
                client.start(thing)  # type: ignore[arg-type]
        with pytest.raises(ReductionError, match="unknown op None"):
            client.allreduce(np.ones(4, np.float32), op=None)  # type: ignore[arg-type]
        assert client.pipeline.wakeup() == float("inf")  # no round was started
        assert net.next_arrival() == float("inf")  # and nothing was sent
        # An empty array is reduced at once (as a round it waited out its deadline), off the
        # wire.
        assert client.allreduce(np.zeros((0, 4), np.float32)).shape == (0, 4)
        assert net.next_arrival() == float("inf")
