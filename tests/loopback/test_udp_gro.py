"""UDP GRO on loopback (real sockets, no root): a GSO burst arrives as one receive call and is
cut back into its datagrams, on the appliance core's transport and on the worker's."""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.icmpwatch import IcmpWatch
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import CoreConfig
from reduction_appliance.dataplane.transport import RxBatch, Send, datagram_starts
from reduction_appliance.dataplane.udp import (
    SO_TIMESTAMPNS,
    UDP_GRO,
    DatagramBatcher,
    UdpCoreTransport,
    receive_facts,
    segment_size,
)
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
)
from reduction_appliance.plugin.transport import UdpWorkerTransport
from tests.capabilities import needs_raw_icmp
from tests.waiting import wait_until

SEGMENT = 1024  # payload bytes per datagram


def header(k: int, kind: Kind = Kind.CONTRIBUTION, length: int = SEGMENT) -> Header:
    return Header(kind, DType.FLOAT32, Op.SUM, Flags.NONE, 1, 0, 99, 1, k, k * SEGMENT, length,
                  1, 1)


def packed(h: Header) -> bytes:
    buf = bytearray(HEADER_SIZE)
    pack_into(buf, h)
    return bytes(buf)


def gso_burst(dest: tuple[str, int], count: int, last: int = SEGMENT,
              kind: Kind = Kind.CONTRIBUTION) -> list[bytes]:
    """Send `count` datagrams to `dest` in one GSO sendmsg (the last `last` bytes of payload);
    the payloads each datagram carries."""
    payloads = [bytes([k]) * (SEGMENT if k < count - 1 else last) for k in range(count)]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        batcher = DatagramBatcher(sock)
        batcher.add_all((dest, packed(header(k, kind, len(payload))), memoryview(payload))
                        for k, payload in enumerate(payloads))
        batcher.flush()
        assert batcher.take_counts()[2] == 0 and not batcher.gso_refused
    return payloads


@pytest.fixture
def core() -> Iterator[UdpCoreTransport]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    transport = UdpCoreTransport(sock)
    if transport.gro_refused:
        sock.close()
        pytest.skip(f"the kernel refuses UDP_GRO: {transport.gro_refused}")
    try:
        yield transport
    finally:
        transport.close()


def received(core: UdpCoreTransport, arena: SlotArena, want: int) -> list[bytes]:
    """The first `want` datagrams the core receives, cut apart from its coalesced runs."""
    batch = RxBatch()
    got: list[bytes] = []

    def more() -> bool:
        core.receive(arena.rx, batch, 256)
        got.extend(bytes(arena.rx.views[index][:nbytes])  # without GRO: in receive buffers
                   for index, nbytes in zip(batch.index, batch.nbytes, strict=True))
        for staging, nbytes, size, _ in batch.runs:  # with GRO: runs, left in staging
            got.extend(bytes(staging.buffer[start:min(start + size, nbytes)])
                       for start in datagram_starts(nbytes, size))
        return len(got) >= want
    wait_until(more, 10, what=f"{want} datagrams at the core")
    return got


def results(worker: UdpWorkerTransport, count: int) -> list[tuple[int, bytes]]:
    """(slot, payload) of the first `count` datagrams `worker` receives, in order."""
    seen: list[tuple[int, bytes]] = []

    def enough() -> bool:
        worker.receive(lambda h, payload, _: seen.append((h.slot, bytes(payload))))
        return len(seen) >= count
    wait_until(enough, 10, what=f"{count} results at the worker")
    return seen

def test_a_gso_burst_reaches_the_core_in_one_receive_and_is_cut_apart(
        core: UdpCoreTransport) -> None:
    with SlotArena(capacity=4, max_payload=SEGMENT, rx_buffers=128) as arena:
        payloads = gso_burst(core.sock.getsockname(), 7, last=100)
        got = received(core, arena, 7)
        assert core.coalesced == 1  # one receive call brought all seven
        assert [datagram[HEADER_SIZE:] for datagram in got] == payloads
        assert arena.rx.free == 128  # left in the transport's staging, no buffer taken


def test_the_core_leaves_a_burst_queued_while_its_buffers_could_not_hold_one(
        core: UdpCoreTransport) -> None:
    with SlotArena(capacity=4, max_payload=SEGMENT, rx_buffers=70) as arena:
        taken = [arena.rx.take() for _ in range(10)]  # 60 free: fewer than a burst may need
        gso_burst(core.sock.getsockname(), 7)
        batch = RxBatch()
        assert core.receive(arena.rx, batch, 256) == 0  # waits in the kernel, not dropped
        for index in taken:
            assert index is not None
            arena.rx.release(index)
        assert len(received(core, arena, 7)) == 7


def test_the_worker_cuts_a_burst_of_results_apart() -> None:
    with UdpWorkerTransport("127.0.0.1") as worker:
        if worker.gro_refused:
            pytest.skip(f"the kernel refuses UDP_GRO: {worker.gro_refused}")
        payloads = gso_burst(worker.local, 5, last=8, kind=Kind.RESULT)
        assert results(worker, 5) == list(enumerate(payloads)) and worker.coalesced == 1


def test_without_gro_each_datagram_is_its_own_receive() -> None:
    with UdpWorkerTransport("127.0.0.1", gro=False) as worker:
        payloads = gso_burst(worker.local, 3, kind=Kind.RESULT)
        assert results(worker, 3) == list(enumerate(payloads)) and worker.coalesced == 0


def test_segment_size_reads_the_kernels_control_message() -> None:
    assert segment_size([], 5000) == 5000
    four = (1072).to_bytes(4, "little" if socket.htons(1) != 1 else "big")
    assert segment_size([(socket.SOL_UDP, UDP_GRO, four)], 7000) == 1072
    assert segment_size([(socket.SOL_IP, 1, four)], 7000) == 7000  # not ours


def held_burst(worker: UdpWorkerTransport, hold_s: float) -> tuple[float, float]:
    """Send the worker a burst, leave it unread for `hold_s`, then take it in: the `waited` its
    run handler was given, and the most it can truly have waited (from before the send)."""
    sent = time.time()
    gso_burst(worker.local, 3, kind=Kind.RESULT)  # on loopback: queued when this returns
    time.sleep(hold_s)  # the host's own wait under test (the worker not reading meanwhile)
    waits: list[float] = []

    def taken() -> bool:
        worker.receive(lambda h, payload, _: None,
                       lambda buf, view, nbytes, size, source, waited: waits.append(waited))
        return bool(waits)
    wait_until(taken, 10, what="the burst at the worker")
    return waits[0], time.time() - sent


def test_the_worker_is_told_how_long_a_burst_waited_in_its_host() -> None:
    """The kernel's receive time (SO_TIMESTAMPNS) against time.time(): what a run handler is
    given as `waited` (plugin/answers.py ends a delay sample there)."""
    with UdpWorkerTransport("127.0.0.1") as worker:
        if worker.stamps_refused:
            pytest.skip(f"the kernel refuses SO_TIMESTAMPNS: {worker.stamps_refused}")
        # The kernel turns its arrival stamps on a moment after the first socket asks (a
        # deferred switch); until then a datagram is stamped when it is read.
        wait_until(lambda: held_burst(worker, 0.005)[0] >= 0.005, 10,
                   what="the kernel stamping datagrams on arrival")
        waited, most = held_burst(worker, 0.05)
        # It waited from its arrival (after the send, before the hold) until it was read.
        assert 0.05 <= waited <= most


def test_receive_facts_reads_the_size_and_the_kernels_receive_time() -> None:
    assert receive_facts([], 5000) == (5000, 0.0)
    four = (1072).to_bytes(4, "little" if socket.htons(1) != 1 else "big")
    stamp = struct.pack("@qq", 1_800_000_000, 250_000_000)
    size, stamped = receive_facts([(socket.SOL_UDP, UDP_GRO, four),
                                   (socket.SOL_SOCKET, SO_TIMESTAMPNS, stamp)], 7000)
    assert size == 1072 and stamped == pytest.approx(1_800_000_000.25)
    assert receive_facts([(socket.SOL_IP, 1, stamp)], 7000) == (7000, 0.0)  # not ours


def test_a_kernel_refusing_gro_leaves_one_receive_per_datagram(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("reduction_appliance.plugin.transport.enable_gro",
                        lambda sock: "ENOPROTOOPT: Protocol not available")
    with UdpWorkerTransport("127.0.0.1") as worker:
        assert worker.gro_refused == "ENOPROTOOPT: Protocol not available"
        payloads = gso_burst(worker.local, 2, kind=Kind.RESULT)
        assert results(worker, 2) == list(enumerate(payloads))


def test_the_core_names_a_refused_gro_as_a_fallback() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    transport = UdpCoreTransport(sock, gro=False)
    try:
        assert any("UDP GRO" in f for f in transport.fallbacks())
    finally:
        transport.close()


def test_a_pool_too_small_to_spare_a_burst_receives_one_datagram_per_call() -> None:
    cfg = CoreConfig(index=0, cpu=None, bind=("127.0.0.1", 0), max_payload=SEGMENT,
                     slot_capacity=4, rx_buffers=64)
    transport = UdpCoreTransport.open(cfg)
    try:
        assert ("UDP GRO off (dataplane.rx_buffers 64 is below 128): one receive call per "
                "contribution") in transport.fallbacks()
        with SlotArena(capacity=4, max_payload=SEGMENT, rx_buffers=64) as arena:
            payloads = gso_burst(transport.sock.getsockname(), 3)
            got = received(transport, arena, 3)
            assert [datagram[HEADER_SIZE:] for datagram in got] == payloads
            assert arena.rx.free == 64 - 3  # each in a receive buffer of its own
            assert transport.coalesced == 0
    finally:
        transport.close()


def test_an_empty_datagram_reaches_the_core_as_one_and_stops_nothing(
        core: UdpCoreTransport) -> None:
    """An empty datagram (anyone may send one) used to stop the core's receive with a zero
    segment size; it is one datagram of 0 bytes, which the aggregator counts as malformed."""
    with SlotArena(capacity=4, max_payload=SEGMENT, rx_buffers=128) as arena, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"", core.sock.getsockname())
        assert received(core, arena, 1) == [b""]
        gso_burst(core.sock.getsockname(), 3)
        assert len(received(core, arena, 3)) == 3  # and the core goes on receiving


def test_an_empty_datagram_stops_no_worker() -> None:
    with UdpWorkerTransport("127.0.0.1") as worker, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"", worker.local)
        payloads = gso_burst(worker.local, 2, kind=Kind.RESULT)
        assert results(worker, 2) == list(enumerate(payloads))


def test_a_transport_over_given_sockets_receives_and_sends_on_them() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
        worker = UdpWorkerTransport.over([sock])
        assert worker.local == sock.getsockname() and worker.gro_refused == ""
        payloads = gso_burst(worker.local, 3, kind=Kind.RESULT)
        assert results(worker, 3) == list(enumerate(payloads))
    with pytest.raises(ValueError, match="at least one socket"):
        UdpWorkerTransport.over([])


def test_after_a_wait_the_worker_asks_only_the_sockets_found_readable_and_loses_nothing(
) -> None:
    """`wait` remembers which sockets select found readable, and the next `receive` asks only
    those (an empty one costs an exception per turn). A datagram that reaches another socket
    meanwhile is not lost: the next `wait` returns at once, and its `receive` takes it."""
    unicast, group = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    for sock in (unicast, group):
        sock.bind(("127.0.0.1", 0))
    with UdpWorkerTransport.over([unicast, group]) as worker, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
        def result(k: int) -> bytes:
            buf = bytearray(HEADER_SIZE)
            pack_into(buf, header(k, Kind.RESULT, 4))
            return bytes(buf) + bytes([k]) * 4

        def turn(timeout: float) -> list[int]:
            seen: list[int] = []
            worker.wait(timeout)
            worker.receive(lambda h, payload, _: seen.append(h.slot))
            return seen
        peer.sendto(result(1), group.getsockname())
        assert turn(10.0) == [1]
        peer.sendto(result(2), group.getsockname())
        wait_until(lambda: bool(select.select([group], [], [], 0)[0]), 10, what="the datagram")
        worker.wait(0.0)  # finds the group socket readable
        peer.sendto(result(3), unicast.getsockname())  # arrives after the select
        wait_until(lambda: bool(select.select([unicast], [], [], 0)[0]), 10,
                   what="the datagram")
        seen: list[int] = []
        worker.receive(lambda h, payload, _: seen.append(h.slot))
        assert seen == [2]  # the unicast socket was not asked
        assert turn(10.0) == [3]  # the next turn takes it
        peer.sendto(result(4), unicast.getsockname())
        wait_until(lambda: bool(select.select([unicast], [], [], 0)[0]), 10,
                   what="the datagram")
        seen.clear()
        worker.receive(lambda h, payload, _: seen.append(h.slot))  # no wait before: all asked
        assert seen == [4]


@pytest.mark.parametrize(("address", "why"), [("198.51.100.7", "Cannot assign requested address"),
                                              ("not-an-address", "")])
def test_a_worker_address_not_on_this_host_is_refused_naming_the_setting(address: str,
                                                                         why: str) -> None:
    """(An OSError or a socket.gaierror with no word of where the address came from before.)"""
    with pytest.raises(ReductionError) as refused:
        UdpWorkerTransport(address)
    text = str(refused.value)
    assert f"cannot send from local address {address!r} (REDUCTION_LOCAL_ADDRESS" in text
    assert why in text and "an IPv4 address of this host" in text


def test_a_core_refused_a_raw_socket_says_it_watches_no_closed_ports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CAP_NET_RAW a core cannot read ICMP port unreachable (dataplane.reach): it says
    so among its fallbacks, and tells its loop it cannot tell closed ports (no REACHes)."""
    why = "no raw ICMP socket (Operation not permitted: CAP_NET_RAW is needed): ..."
    monkeypatch.setattr(IcmpWatch, "open", classmethod(lambda cls, bound: why))
    cfg = CoreConfig(index=0, cpu=None, bind=("127.0.0.1", 0), max_payload=SEGMENT,
                     slot_capacity=4, rx_buffers=256)
    transport = UdpCoreTransport.open(cfg)
    try:
        assert transport.fallbacks() == (f"closed ports not watched: {why}",)
        assert transport.closed_ports() is None
    finally:
        transport.close()


@needs_raw_icmp
def test_a_core_reads_the_port_unreachable_its_datagram_to_a_closed_port_brings() -> None:
    cfg = CoreConfig(index=0, cpu=None, bind=("127.0.0.1", 0), max_payload=SEGMENT,
                     slot_capacity=4, rx_buffers=256)
    transport = UdpCoreTransport.open(cfg)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as gone:
            gone.bind(("127.0.0.1", 0))
            closed = gone.getsockname()
        transport.send([Send(closed, bytes(HEADER_SIZE), b"")])
        assert wait_until(lambda: transport.closed_ports(), 5.0,
                          what="the port unreachable") == [closed]
        assert transport.fallbacks() == ()
    finally:
        transport.close()
