"""GSO batching decisions, against a socket stand-in that records what it was asked to send."""

from __future__ import annotations

import errno
import socket
import struct
from typing import Any

from reduction_appliance.dataplane.udp import UDP_SEGMENT, DatagramBatcher

A = ("198.18.0.1", 7000)
B = ("198.18.0.2", 7000)


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
