"""GSO batching decisions, against a socket stand-in that records what it was asked to send."""

from __future__ import annotations

import errno
import socket
import struct
from typing import Any

from reduction_appliance.dataplane.transport import Send
from reduction_appliance.dataplane.udp import (
    UDP_SEGMENT,
    DatagramBatcher,
    UdpCoreTransport,
    by_destination,
)

A = ("198.18.0.1", 7000)
B = ("198.18.0.2", 7000)
GROUP = ("239.255.0.1", 7000)


class RecordingSocket:
    def __init__(self, refuse_gso: bool = False, narrow: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[list[bytes], list[Any], tuple[str, int]]] = []
        self.refuse_gso = refuse_gso
        self.narrow = narrow  # a destination whose route MTU is below our datagrams

    def sendmsg(self, iov: list[Any], ancdata: Any = (), flags: int = 0,
                dest: tuple[str, int] | None = None) -> int:
        assert dest is not None
        if ancdata and self.refuse_gso:
            raise OSError(errno.EIO, "no GSO here")
        if ancdata and dest == self.narrow:
            raise OSError(errno.EMSGSIZE, "Message too long")
        self.calls.append(([bytes(b) for b in iov], list(ancdata), dest))
        return sum(len(b) for b in iov)


def batcher(sock: RecordingSocket) -> DatagramBatcher:
    return DatagramBatcher(sock)  # type: ignore[arg-type]


def test_same_destination_same_size_leave_in_one_gso_send_with_a_shorter_last() -> None:
    sock = RecordingSocket()
    b = batcher(sock)
    for i in range(3):
        b.add(A, bytes([i]) * 4, b"x" * 100)
    b.add(A, b"hdr!", b"y" * 10)  # shorter: may close the group
    b.add(A, b"hdr!", b"z" * 100)  # after a shorter one: a new send
    b.flush()
    assert len(sock.calls) == 2
    iov, cmsg, dest = sock.calls[0]
    assert dest == A and len(iov) == 8
    assert cmsg == [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", 104))]
    assert sock.calls[1][1] == []  # a single datagram needs no segmentation
    assert b.take_counts() == (5, 4 * 104 + 14, 0)


def test_destination_change_and_size_limit_split_batches() -> None:
    sock = RecordingSocket()
    b = batcher(sock)
    b.add(A, b"h", b"1" * 9000)
    b.add(B, b"h", b"1" * 9000)
    for _ in range(8):  # 8 x 9001 bytes exceed one 65000-byte GSO send
        b.add(A, b"h", b"2" * 9000)
    b.flush()
    assert [(len(iov) // 2, dest) for iov, _, dest in sock.calls] == [(1, A), (1, B), (7, A),
                                                                       (1, A)]


def test_without_gso_every_datagram_is_sent_alone() -> None:
    sock = RecordingSocket(refuse_gso=True)
    b = batcher(sock)
    for _ in range(3):
        b.add(A, b"h", b"p" * 50)
    b.flush()
    assert [len(iov) for iov, _, _ in sock.calls] == [2, 2, 2]
    assert not b.gso and b.take_counts() == (3, 153, 0)
    assert b.gso_refused == "EIO: no GSO here"  # the core reports it as a fallback


def test_a_route_too_narrow_to_segment_gets_one_datagram_per_call_and_only_it() -> None:
    """The kernel segments only datagrams that fit one frame of the route (EMSGSIZE
    otherwise); alone, each leaves as IP fragments. Other destinations keep GSO."""
    sock = RecordingSocket(narrow=B)
    b = batcher(sock)
    for _ in range(3):
        b.add(B, b"h", b"p" * 50)
    b.flush()
    assert [len(iov) for iov, _, _ in sock.calls] == [2, 2, 2]
    assert b.take_counts() == (3, 153, 0)
    assert b.gso_refused.startswith("EMSGSIZE: datagrams of 51 bytes are wider than the route "
                                    "to 198.18.0.2:7000")
    sock.calls.clear()
    for _ in range(3):
        b.add(B, b"h", b"p" * 50)  # known narrow: not even tried as one GSO send
    for _ in range(3):
        b.add(A, b"h", b"p" * 50)
    b.flush()
    assert [(len(iov), cmsg != [], dest) for iov, cmsg, dest in sock.calls] == [
        (2, False, B), (2, False, B), (2, False, B), (6, True, A)]
    assert b.gso and b.take_counts() == (6, 306, 0)


def test_a_lossy_bursts_notices_do_not_split_its_results_to_the_group() -> None:
    """On a lossy network a burst's results to the job's group come mixed with unicast
    notices (a PENDING to a rank that asked, or to one whose contribution never came): the
    core sends each destination's datagrams together, in their order, so the results leave
    in one GSO send where they would have left in four."""
    sends = [Send(GROUP, bytes([0]) * 4, b"r" * 100), Send(A, b"pend", b"1"),
             Send(GROUP, bytes([1]) * 4, b"r" * 100), Send(B, b"pend", b"2"),
             Send(GROUP, bytes([2]) * 4, b"r" * 100), Send(A, b"pend", b"3"),
             Send(GROUP, bytes([3]) * 4, b"r" * 100)]
    assert by_destination(sends) == [sends[i] for i in (0, 2, 4, 6, 1, 5, 3)]
    one_destination = sends[::2]
    assert by_destination(one_destination) is one_destination  # the usual burst: as it is
    assert by_destination([]) == []
    sock = RecordingSocket()
    core = UdpCoreTransport.__new__(UdpCoreTransport)  # its send path alone, on the stand-in
    core.batcher = batcher(sock)
    core.send(sends)
    assert [(len(iov) // 2, dest) for iov, _, dest in sock.calls] == [(4, GROUP), (2, A),
                                                                       (1, B)]
    assert sock.calls[0][0][::2] == [bytes([i]) * 4 for i in range(4)]
    assert sock.calls[1][0][1::2] == [b"1", b"3"]
