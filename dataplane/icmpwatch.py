"""Which workers' ports are closed: ICMP port unreachable answering a core's datagrams.

A raw ICMP socket gets a copy of every ICMP message that reaches the host (the kernel filters
all but destination unreachable for us). Each quotes the IP and UDP headers of the datagram it
answers, so a core reads the closed endpoint from them (dataplane.reach says why). It keeps
those answering any UDP datagram from its own address (when bound to one), not only its own
port's: a host rate-limits its ICMP, and the answer that comes may be to another core's
datagram. Only an endpoint a rank joined from means anything (dataplane.reach).

Not `IP_RECVERR` on the core's socket: that also makes the socket's next send fail with the
error, losing a result to whichever worker it was for.

A raw socket needs CAP_NET_RAW; without it the core says so among its fallbacks, and a worker
whose process ended is found by the liveness timeout instead.
"""

from __future__ import annotations

import socket
import struct

from .spec import Address

__all__ = ["IcmpWatch", "port_unreachable"]

_SOL_RAW = 255
_ICMP_FILTER = 1  # a mask of the ICMP types the kernel drops for this socket
_DEST_UNREACH = 3
_PORT_UNREACH = 3
_PORT = struct.Struct("!H")
_MOST_PER_TAKE = 64  # a flood of ICMP cannot hold the core's loop for long


def port_unreachable(packet: bytes | memoryview,
                     address: bytes = b"\0\0\0\0") -> Address | None:
    """The endpoint a port-unreachable `packet` (an IPv4 packet as a raw socket gets it) says
    is closed, if it answers a UDP datagram sent from `address` (packed; any, for 0.0.0.0);
    None for anything else, truncated or not."""
    if len(packet) < 20:
        return None
    outer = (packet[0] & 0x0F) * 4
    quoted = outer + 8
    if len(packet) < quoted + 20 or packet[outer] != _DEST_UNREACH \
            or packet[outer + 1] != _PORT_UNREACH:
        return None
    inner = (packet[quoted] & 0x0F) * 4
    udp = quoted + inner
    if inner < 20 or len(packet) < udp + 4 or packet[quoted + 9] != socket.IPPROTO_UDP:
        return None
    source, dest = bytes(packet[quoted + 12:quoted + 16]), bytes(packet[quoted + 16:quoted + 20])
    if address != b"\0\0\0\0" and source != address:
        return None
    return socket.inet_ntoa(dest), _PORT.unpack_from(packet, udp + 2)[0]


class IcmpWatch:
    """The ports found closed behind the datagrams this host sends from a core's address
    (`take`)."""

    def __init__(self, sock: socket.socket, bound: Address) -> None:
        self.sock = sock
        self._address = socket.inet_aton(bound[0])
        self._buffer = bytearray(576)  # an ICMP error quotes at most 576 bytes in all

    @classmethod
    def open(cls, bound: Address) -> IcmpWatch | str:
        """A watch for the socket bound to `bound`, or why there is none."""
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        except OSError as exc:
            return (f"no raw ICMP socket ({exc.strerror or exc}: CAP_NET_RAW is needed): a "
                    "worker whose process ended is found by the liveness timeout")
        try:
            sock.setsockopt(_SOL_RAW, _ICMP_FILTER,
                            struct.pack("=I", ~(1 << _DEST_UNREACH) & 0xFFFFFFFF))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            return (f"this kernel refuses ICMP_FILTER on a raw socket ({exc.strerror or exc}): "
                    "a worker whose process ended is found by the liveness timeout")
        except BaseException:
            sock.close()
            raise
        return cls(sock, bound)

    def take(self) -> list[Address]:
        """The endpoints found closed since the last call (each as often as it was said)."""
        found = []
        buffer = self._buffer
        for _ in range(_MOST_PER_TAKE):
            try:
                nbytes = self.sock.recv_into(buffer)
            except BlockingIOError:
                break
            closed = port_unreachable(memoryview(buffer)[:nbytes], self._address)
            if closed is not None:
                found.append(closed)
        return found

    def close(self) -> None:
        self.sock.close()
