"""A worker's coalesced receives (the client's run path) against one datagram at a time.

Two clients of the same job and rank run the same round; each receives the same datagrams
(results, duplicates, stale and foreign ones, notices, garbage) from the cores. One takes them
as its transport coalesces them (`RoundPipeline.take_results`, the rest decoded one by one);
the other's transport hands over one datagram at a time. They must end up alike: the same
array, the same results rejected, the same round-trip estimates and congestion windows (the
results name either rank as their completer, some with the QUEUED or REPAIRED mark or resent,
after waits over the windows' target and under it), the same segments still to send or ask
after."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reduction_appliance.dataplane.registration import EndpointInfo
from reduction_appliance.dataplane.transport import Address, MemoryNetwork
from reduction_appliance.dataplane.wire import (
    FLAGS_AT,
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
)
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import JobInfo
from reduction_appliance.plugin.rtt import Timing
from reduction_appliance.plugin.transport import Handler, MemoryWorkerTransport, RunHandler

JOB, COOKIE, WORLD, SLOTS, SEGMENT = 3, 0xBEEF, 2, 4, 256
CORES = (("198.18.0.1", 7000), ("198.18.0.1", 7001))
ELEMENTS = 64 * 16  # 16 segments of 256 bytes
TARGET = 0.025  # the round trip over which a queue stands (plugin/congestion.py)


class OneByOne(MemoryWorkerTransport):
    """Hands every datagram over alone, whatever the client offers to take runs with."""

    def receive(self, handle: Handler, take_run: RunHandler | None = None) -> int:
        return super().receive(handle)


def client(net: MemoryNetwork, where: Address, transport: type[MemoryWorkerTransport]
           ) -> ApplianceClient:
    info = JobInfo("memory", JOB, "runs", WORLD, SEGMENT, None, False, 30.0,
                   tuple(EndpointInfo(i, host, port, SLOTS) for i, (host, port) in
                         enumerate(CORES)), cookie=COOKIE, queue_target_s=TARGET)
    return ApplianceClient([info], 0, timing=Timing(0.01, 0.002, 0.2, 30.0), clock=net.clock,
                           transport=transport(net, where), lease=False)


def result(k: int, *, kind: Kind = Kind.RESULT, use: int | None = None, round_no: int = 1,
           cookie: int = COOKIE, serial: int = 0, value: float = 3.0, completer: int = 0,
           flags: Flags = Flags.NONE) -> bytes:
    """The RESULT of segment k (of the first round, unless `round_no` and `use` say), as its
    core sends it; `completer`: the rank whose contribution completed it (the clients are
    rank 0), `flags`: its marks (QUEUED, REPAIRED; RETRANSMIT: resent to this rank alone)."""
    pending = kind is Kind.PENDING  # its payload: the ranks in (rank 1 only: ours never came)
    h = Header(kind, DType.FLOAT32, Op.SUM, Flags.NONE if pending else flags, JOB,
               completer, cookie, round_no,
               (k // 2) % SLOTS, k * SEGMENT, 1 if pending else SEGMENT,
               (k // 2) // SLOTS + 1 if use is None else use, 1, serial)
    buf = bytearray(HEADER_SIZE)
    pack_into(buf, h)
    if pending:
        return bytes(buf) + b"\x02"
    return bytes(buf) + np.full(SEGMENT // 4, value, np.float32).tobytes()


_MARKS = st.sampled_from([Flags.NONE, Flags.QUEUED, Flags.REPAIRED, Flags.QUEUED | Flags.REPAIRED,
                          Flags.RETRANSMIT])
_SPOILS = st.sampled_from(["none"] * 8 + ["duplicate", "use", "round", "cookie", "garbage",
                                          "pending", "short", "stranger"])


@st.composite
def deliveries(draw: st.DrawFn) -> list[tuple[float, Address, list[bytes]]]:
    """Runs of results of consecutive segments of one core (k, k + 2, ...), some spoiled,
    each after a wait."""
    out: list[tuple[float, Address, list[bytes]]] = []
    for e in draw(st.permutations(range(2))):
        segments = list(range(e, 16, 2))
        at = 0
        while at < len(segments):
            n = draw(st.integers(1, len(segments) - at))
            run = [result(k, serial=k, completer=draw(st.integers(0, WORLD - 1)),
                          flags=draw(_MARKS)) for k in segments[at:at + n]]
            source = CORES[e]
            i = draw(st.integers(0, n - 1))
            spoil = draw(_SPOILS)
            k = segments[at + i]
            if spoil == "duplicate":
                run.insert(i, run[i])
            elif spoil == "use":
                run[i] = result(k, use=9)
            elif spoil == "round":
                run[i] = result(k, round_no=2)
            elif spoil == "cookie":
                run[i] = result(k, cookie=COOKIE + 1)
            elif spoil == "garbage":
                run[i] = bytes(draw(st.binary(min_size=len(run[i]), max_size=len(run[i]))))
            elif spoil == "pending":
                run.insert(i, result(k, kind=Kind.PENDING))
            elif spoil == "short":
                run[i] = run[i][:HEADER_SIZE + 8]
            elif spoil == "stranger":
                source = CORES[1 - e]
            out.append((draw(st.sampled_from([0.0, 0.01, 0.03, 0.06])), source, run))
            at += n
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deliveries())
def test_a_worker_takes_coalesced_results_as_it_would_one_by_one(
        runs: list[tuple[float, Address, list[bytes]]]) -> None:
    net = MemoryNetwork()
    cores = [net.bind(core) for core in CORES]  # where the contributions go (unread)
    places = [("198.18.0.101", 40000), ("198.18.0.102", 40000)]
    clients = [client(net, places[0], MemoryWorkerTransport), client(net, places[1], OneByOne)]
    arrays = [np.zeros(ELEMENTS, np.float32) for _ in clients]
    try:
        for c, a in zip(clients, arrays, strict=True):
            c.start(a)
            c.progress(timeout=0)  # the first window leaves
        for wait, source, run in runs:
            net.advance(net.now + wait)
            for place in places:
                for datagram in run:
                    net.transmit(source, place, datagram)
            net.advance(net.next_arrival())
            for c in clients:
                c.progress(timeout=0)
        coalesced, alone = clients
        assert np.array_equal(arrays[0], arrays[1])
        assert coalesced.pipeline.rejected == alone.pipeline.rejected
        assert ([coalesced.pipeline.rtt.srtt(e) for e in range(2)]
                == [alone.pipeline.rtt.srtt(e) for e in range(2)])
        states = []
        for c in clients:
            w = c.pipeline.window
            assert w is not None
            states.append((w.limit, w.queued, w.measured, w.cuts, w.least, w.samples))
        assert states[0] == states[1]
        # (the rounds' own bookkeeping: which segment of each core always goes, what waits)
        assert ([(r._lowest, list(r._ready), r.remaining)
                 for r in coalesced.pipeline._active.values()]
                == [(r._lowest, list(r._ready), r.remaining)
                    for r in alone.pipeline._active.values()])
        net.advance(net.now + 1.0)  # every timer due: what each would ask after, and send
        assert ([(t.endpoint, t.segment, t.header) for t in coalesced.pipeline.due(net.now)]
                == [(t.endpoint, t.segment, t.header) for t in alone.pipeline.due(net.now)])
    finally:
        for c in clients:
            c.close()
        for core in cores:
            core.close()


def test_a_coalesced_run_of_results_fills_the_array() -> None:
    net = MemoryNetwork()
    cores = [net.bind(core) for core in CORES]
    c = client(net, ("198.18.0.101", 40000), MemoryWorkerTransport)
    array = np.zeros(ELEMENTS, np.float32)
    try:
        ticket = c.start(array)
        c.progress(timeout=0)
        for window in range(2):  # eight segments in flight: a window, then the next
            for e, core in enumerate(CORES):
                for k in range(e + 8 * window, 8 + 8 * window, 2):
                    net.transmit(core, ("198.18.0.101", 40000), result(k))
            net.advance(net.next_arrival())
            outcomes = c.progress(timeout=0)
        assert [(o.ticket, o.error) for o in outcomes] == [(ticket, None)]
        assert np.all(array == 3.0) and c.pipeline.rejected == 0
    finally:
        c.close()
        for core in cores:
            core.close()


@pytest.mark.parametrize("transport", [MemoryWorkerTransport, OneByOne])
@pytest.mark.parametrize("resent", [True, False])
def test_a_round_whose_last_result_was_resent_marks_the_next_rounds_first_burst(
        transport: type[MemoryWorkerTransport], resent: bool) -> None:
    """A rank that got its round's last result resent to it alone (RETRANSMIT on a RESULT)
    ends after its peers: the first transmissions of its next round say so (REPAIRED, which
    the RESULTs they complete echo), so that no peer takes the wait for it as a round trip of
    the path. Later first transmissions go unmarked: results clock them, not the repair."""
    net = MemoryNetwork()
    cores = [net.bind(core) for core in CORES]
    place = ("198.18.0.101", 40000)
    c = client(net, place, transport)

    def sent_flags() -> list[int]:
        """The flags of what the cores got since the last call."""
        while (arrival := net.next_arrival()) != float("inf"):
            net.advance(arrival)
        out = []
        for core in cores:
            while (got := core.recv()) is not None:
                out.append(got[0][FLAGS_AT])
        return out

    def answer(ks: range, round_no: int, last_flags: Flags = Flags.NONE) -> None:
        for k in ks:
            use = (k // 2) // SLOTS + 1 + 2 * (round_no - 1)
            flags = last_flags if k == ks[-1] else Flags.NONE
            net.transmit(CORES[k % 2], place, result(k, round_no=round_no, use=use, flags=flags))
        net.advance(net.next_arrival())

    try:
        first = c.start(np.zeros(ELEMENTS, np.float32))
        c.progress(timeout=0)
        assert sent_flags() == [0] * 8
        answer(range(8), 1)
        c.progress(timeout=0)
        answer(range(8, 16), 1, Flags.RETRANSMIT if resent else Flags.NONE)
        assert [(o.ticket, o.error) for o in c.progress(timeout=0)] == [(first, None)]
        assert sent_flags() == [0] * 8  # the first round's second window
        c.start(np.zeros(ELEMENTS, np.float32))
        c.progress(timeout=0)
        assert sent_flags() == [int(Flags.REPAIRED) if resent else 0] * 8
        answer(range(8), 2)
        c.progress(timeout=0)
        assert sent_flags() == [0] * 8
    finally:
        c.close()
        for core in cores:
            core.close()
