"""The transport seam of a worker: what `ApplianceClient` needs from the network.

    transport.send(datagrams)        contributions, batched (GSO where the kernel can)
    transport.receive(handle)        every datagram waiting, decoded: handle(header, payload, src)
    transport.wait(timeout, wake)    block until something arrives, `timeout` passes or `wake`

Results are received into the transport's own buffer and the client copies each payload into
the caller's array (one memcpy, cheaper than a second system call per datagram). With UDP GRO
(where the kernel grants it) one receive call brings up to 64 KB of consecutive results from
one core, cut apart here. The UDP
implementation is `UdpWorkerTransport`; `MemoryWorkerTransport` runs on
`dataplane.transport.MemoryNetwork` for tests (no sockets, simulated time).
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, Self

from reduction_appliance.dataplane.errors import PeerError, ReductionError
from reduction_appliance.dataplane.transport import Address, MemoryEndpoint, MemoryNetwork
from reduction_appliance.dataplane.udp import (
    GRO_BUFFER,
    STAMPED_CMSG_SPACE,
    DatagramBatcher,
    datagram_starts,
    enable_gro,
    enable_stamps,
    enlarge_buffers,
    receive_facts,
)
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    IP_UDP_HEADERS,
    Header,
    unpack,
)

__all__ = [
    "Handler",
    "MemoryWorkerTransport",
    "Outgoing",
    "RunHandler",
    "UdpWorkerTransport",
    "WorkerTransport",
    "decode_each",
]

_IP_MTU = getattr(socket, "IP_MTU", 14)  # Linux: a connected socket's route MTU
_SOCKET_BUFFER = 32 * 1024 * 1024
_TRANSIENT = {errno.ENOBUFS, errno.EAGAIN, errno.EWOULDBLOCK}  # a full queue: like a loss
_RECEIVE_BUFFER = GRO_BUFFER  # the largest datagram, or the most one coalesced receive brings

#: handle(header, payload, source): one received datagram, valid only during the call
Handler = Callable[[Header, memoryview, Address], None]
#: take_run(buffer, view, nbytes, size, source, waited): a coalesced receive (UDP GRO) of
#: datagrams `size` bytes apart, the last possibly shorter, all from `source`, that waited in
#: this host `waited` seconds before it was read (0.0 where the kernel did not say); valid
#: only during the call
RunHandler = Callable[[bytearray, memoryview, int, int, Address, float], None]


def decode_each(buf: bytearray, view: memoryview, start: int, nbytes: int, size: int,
                source: Address, handle: Handler) -> None:
    """Hand the datagrams of a coalesced receive from `start` on to `handle`, one by one:
    decoded, and dropped when malformed or when their payload is not the length their header
    says."""
    for at in datagram_starts(nbytes - start, size):
        at += start
        end = min(at + size, nbytes)
        if end - at < HEADER_SIZE:
            continue
        try:
            h = unpack(buf, at)
        except PeerError:
            continue
        if end - at == HEADER_SIZE + h.length:
            handle(h, view[at + HEADER_SIZE:end], source)


class Outgoing(NamedTuple):
    dest: Address
    header: bytes | bytearray | memoryview  # packed: wire.HEADER_SIZE bytes
    payload: memoryview


class WorkerTransport(Protocol):
    #: True when nothing is lost in transit (RDMA RC): the client's timers start long
    reliable: bool

    def send(self, datagrams: Sequence[Outgoing]) -> None:
        """Transmit; a full queue counts as a loss (retransmission repairs it), a dead route
        raises `ReductionError`."""
        ...

    def receive(self, handle: Handler, take_run: RunHandler | None = None) -> int:
        """Hand every datagram waiting now to `handle` (malformed ones are dropped), or, where
        datagrams arrive coalesced and `take_run` is given, each coalesced receive whole to
        `take_run` (which may `decode_each` what it leaves); return how many datagrams were
        taken off the queue."""
        ...

    def wait(self, timeout: float | None, wake: socket.socket | None = None) -> None:
        """Block until a datagram waits, `timeout` seconds pass (None: no limit) or `wake`
        is readable."""
        ...

    def source_for(self, dest: Address) -> Address:
        """The address and port datagrams to `dest` leave from (what a rank joins with)."""
        ...

    def send_raw(self, datagram: bytes, dest: Address) -> None:
        """Send one datagram now; safe from another thread (the heartbeat lease); a failure is
        a lost heartbeat, never raised."""
        ...

    def close(self) -> None:
        ...


class UdpWorkerTransport:
    """One UDP socket for contributions and unicast results, plus one socket per multicast
    group results come back on (bound to the group: it hears only that group)."""

    reliable = False

    def __init__(self, local_address: str = "0.0.0.0",
                 groups: Sequence[Address] = (), *, gro: bool = True) -> None:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            enlarge_buffers(sock, _SOCKET_BUFFER)
            try:
                sock.bind((local_address, 0))
            except OSError as exc:  # (socket.gaierror too: not an address at all)
                raise ReductionError(
                    f"cannot send from local address {local_address!r} "
                    f"(REDUCTION_LOCAL_ADDRESS, or the client's local_address): "
                    f"{exc.strerror or exc}; give an IPv4 address of this host on the data "
                    "network, or 0.0.0.0") from exc
            sockets = [sock, *(stack.enter_context(self._join(group, local_address))
                               for group in dict.fromkeys(groups))]
            stack.pop_all()
        self._adopt(sockets, "turned off" if not gro else next(
            (why for why in map(enable_gro, sockets) if why), ""))
        # The kernel's receive times: where it refuses, a sample keeps our own wait in it.
        self.stamps_refused = next((why for why in map(enable_stamps, sockets) if why), "")

    @classmethod
    def over(cls, sockets: Sequence[socket.socket], gro_refused: str = "") -> Self:
        """A transport over sockets set up elsewhere (the first one sends; all are received
        from), e.g. in-memory stand-ins for a benchmark. `gro_refused` as for the constructor."""
        if not sockets:
            raise ValueError("a worker transport needs at least one socket")
        transport = cls.__new__(cls)
        transport._adopt(list(sockets), gro_refused)
        return transport

    def _adopt(self, sockets: list[socket.socket], gro_refused: str) -> None:
        self._sockets = sockets
        self.sock = sockets[0]
        self._buffer = bytearray(_RECEIVE_BUFFER)
        self._view = memoryview(self._buffer)
        self._batcher = DatagramBatcher(self.sock)
        # Why the kernel refused coalesced receives ("" where it granted them on every socket).
        self.gro_refused = gro_refused
        self.stamps_refused = "unasked"  # (the constructor asks for them)
        self.coalesced = 0  # receive calls that brought more than one datagram
        # datagrams taken from the multicast groups' sockets (plugin/multicast_watch.py)
        self.heard_on_groups = 0
        self._readable: list[socket.socket] | None = None  # what the last `wait` found

    def __enter__(self) -> UdpWorkerTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _join(group: Address, local_address: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            enlarge_buffers(sock, _SOCKET_BUFFER)
            sock.bind(group)
            interface = socket.inet_aton(local_address)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton(group[0]) + interface)
        except BaseException:
            sock.close()
            raise
        return sock

    @property
    def local(self) -> Address:
        """The address the socket is bound to (0.0.0.0 when it is not bound to one)."""
        host, port = self.sock.getsockname()
        return str(host), int(port)

    def source_for(self, dest: Address) -> Address:
        host, port = self.local
        if host == "0.0.0.0":  # the kernel picks the source per route: ask it which
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(dest)
                host = str(probe.getsockname()[0])
        return host, port

    @property
    def receive_buffer(self) -> int:
        """The least receive buffer of its sockets, as the kernel charges it (SO_RCVBUF: twice
        what was granted; capped by net.core.rmem_max for a process that is not root)."""
        return min(int(s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)) for s in self._sockets)

    def route_mtu(self, dest: Address) -> int | None:
        """The MTU of this host's route to `dest` (where the kernel would fragment a datagram
        from our address), or None when the kernel does not say."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((self.local[0], 0))
                probe.connect(dest)
                return int(probe.getsockopt(socket.IPPROTO_IP, _IP_MTU))
            except OSError:
                return None

    def fragmenting_routes(self, dests: Sequence[Address], payload_bytes: int) -> list[str]:
        """For each destination whose route cannot carry a datagram of `payload_bytes` (plus
        our header) whole: why, in words. Such datagrams still arrive, as IP fragments: slower,
        and a lost fragment loses the whole datagram."""
        datagram = HEADER_SIZE + payload_bytes + IP_UDP_HEADERS
        found = []
        for dest in dict.fromkeys(dests):
            mtu = self.route_mtu(dest)
            if mtu is not None and mtu < datagram:
                found.append(f"{dest[0]}:{dest[1]} (route MTU {mtu}, datagrams {datagram})")
        return found

    def send(self, datagrams: Sequence[Outgoing]) -> None:
        batcher = self._batcher
        batcher.add_all(datagrams)
        batcher.flush()
        error, batcher.last_error = batcher.last_error, None
        if error is not None and error.errno not in _TRANSIENT:
            raise ReductionError(f"cannot send to the appliance from {self.local[0]}: "
                                 f"{error}") from error

    def send_raw(self, datagram: bytes, dest: Address) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendto(datagram, dest)

    def receive(self, handle: Handler, take_run: RunHandler | None = None) -> int:
        taken = 0
        buf, view = self._buffer, self._view
        # Right after `wait`, only the sockets it found readable: asking an empty one costs
        # an exception (BlockingIOError), and a worker turns about once per ten results.
        # What arrives there meanwhile wakes the next `wait` at once.
        sockets, self._readable = self._readable or self._sockets, None
        for sock in sockets:
            recv = sock.recvmsg_into
            while True:
                try:
                    nbytes, ancdata, _, source = recv([buf], STAMPED_CMSG_SPACE,
                                                          socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                size, stamped = receive_facts(ancdata, nbytes) if ancdata else (nbytes, 0.0)
                if size < nbytes:
                    self.coalesced += 1
                count = len(datagram_starts(nbytes, size))
                taken += count
                if sock is not self.sock:
                    self.heard_on_groups += count
                if take_run is not None:
                    # How long it sat in this host (our socket, our process not running): no
                    # queue on the path (plugin/congestion.py). The kernel's clock is time.time's.
                    waited = time.time() - stamped if stamped else 0.0
                    take_run(buf, view, nbytes, size, source, waited if waited > 0.0 else 0.0)
                else:
                    decode_each(buf, view, 0, nbytes, size, source, handle)
        return taken

    def wait(self, timeout: float | None, wake: socket.socket | None = None) -> None:
        if not self._sockets:  # closed: select() of nothing would never end
            raise OSError(errno.EBADF, "the worker's UDP transport is closed")
        waitables: list[socket.socket] = [*self._sockets, *([wake] if wake else [])]
        readable, _, _ = select.select(waitables, [], [],
                                       None if timeout is None else max(0.0, timeout))
        # (an empty list, when the timeout ran out, makes `receive` ask every socket)
        self._readable = [sock for sock in readable if sock is not wake]

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        self._readable = None


class MemoryWorkerTransport:
    """`WorkerTransport` on a `MemoryNetwork` (tests): `wait` returns at once, since the test
    moves the simulated clock itself."""

    reliable = False

    def __init__(self, net: MemoryNetwork, address: Address,
                 groups: Sequence[Address] = ()) -> None:
        self.endpoint: MemoryEndpoint = net.bind(address)
        for group in groups:
            net.join(group, address)
        self._coalesced = bytearray(_RECEIVE_BUFFER)

    @property
    def local(self) -> Address:
        return self.endpoint.address

    def source_for(self, dest: Address) -> Address:
        return self.endpoint.address

    def send(self, datagrams: Sequence[Outgoing]) -> None:
        for d in datagrams:
            self.endpoint.sendto(bytes(d.header) + bytes(d.payload), d.dest)

    def send_raw(self, datagram: bytes, dest: Address) -> None:
        self.endpoint.sendto(datagram, dest)

    def receive(self, handle: Handler, take_run: RunHandler | None = None) -> int:
        taken = 0
        if take_run is not None:  # coalesced, as a UDP socket with GRO receives
            buf = self._coalesced
            while (run := self.endpoint.recv_coalesced(buf)) is not None:
                nbytes, size, source = run
                taken += len(datagram_starts(nbytes, size))
                take_run(buf, memoryview(buf), nbytes, size, source, 0.0)
            return taken
        while (got := self.endpoint.recv()) is not None:
            taken += 1
            datagram, source = got
            try:
                h = unpack(datagram)
            except PeerError:
                continue
            if len(datagram) == HEADER_SIZE + h.length:
                handle(h, memoryview(datagram)[HEADER_SIZE:], source)
        return taken

    def wait(self, timeout: float | None, wake: socket.socket | None = None) -> None:
        return None

    def close(self) -> None:
        self.endpoint.close()
