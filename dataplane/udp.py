"""UDP: the data-plane core's transport (`UdpCoreTransport`), and the socket helpers both ends
share (buffer sizing, batched sends with UDP GSO, coalesced receives with UDP GRO).

Python pays microseconds per socket call, and on a veth link most of a datagram's cost is the
send path. UDP generic segmentation offload lets one `sendmsg` carry up to ~64 KB made of
several equal-size datagrams: we gather `[header0, payload0, header1, payload1, ...]` (no copy:
the payloads are views) and the kernel cuts the stream every `segment_size` bytes, so each
datagram on the wire is still one header and one segment. Measured on veth at MTU 9000: ~6 us
per 8.9 KB datagram sent one by one, ~1.5 us with GSO.

Receiving is the mirror image: with `UDP_GRO` set, the kernel (or the NIC) hands a socket
consecutive equal-size datagrams of one flow as one buffer of up to 64 KB, with the segment
size in a control message; we cut it apart again. Copying an 8.9 KB datagram out of that buffer
costs well under a microsecond, a receive call several.
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
from collections.abc import Iterable, Sequence

from .errors import ConfigError
from .icmpwatch import IcmpWatch
from .slots import RxPool
from .spec import CoreConfig
from .transport import RxBatch, Send, Staging, TransportCounts, datagram_starts

__all__ = [
    "GRO_BUFFER",
    "GRO_CMSG_SPACE",
    "STAMPED_CMSG_SPACE",
    "DatagramBatcher",
    "UdpCoreTransport",
    "by_destination",
    "datagram_starts",
    "enable_gro",
    "enable_stamps",
    "enlarge_buffers",
    "receive_facts",
    "segment_size",
]

UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
_SOL_UDP = getattr(socket, "SOL_UDP", 17)
_MAX_GSO_BYTES = 65000  # one GSO send is one IPv4 UDP datagram before segmentation
_MAX_GSO_SEGMENTS = 64
_GSO_UNSUPPORTED = {errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP}
_SIZE = struct.Struct("=H")
_CORE_SOCKET_BUFFER = 64 * 1024 * 1024  # holds a few full windows of every worker
GRO_BUFFER = 65536  # a coalesced receive is one IPv4 datagram's worth at most
GRO_SEGMENTS = 64  # the most datagrams the kernel coalesces into one (UDP_GRO_CNT_MAX)
GRO_CMSG_SPACE = socket.CMSG_SPACE(4)
# The kernel's receive time of each (coalesced) datagram, CLOCK_REALTIME as a timespec.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")
STAMPED_CMSG_SPACE = GRO_CMSG_SPACE + socket.CMSG_SPACE(_TIMESPEC.size)
_STAGING_BUFFERS = 64  # coalesced receives per burst at most: a burst of single datagrams (4 MiB)

Address = tuple[str, int]


def enlarge_buffers(sock: socket.socket, nbytes: int) -> None:
    """Ask for `nbytes` send and receive buffers; as root past the sysctl caps."""
    for force, plain in ((getattr(socket, "SO_RCVBUFFORCE", 33), socket.SO_RCVBUF),
                         (getattr(socket, "SO_SNDBUFFORCE", 32), socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, nbytes)
        except PermissionError:  # not root: the kernel caps at rmem_max/wmem_max
            sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)


def enable_gro(sock: socket.socket) -> str:
    """Ask for coalesced receives; "" when granted, else the kernel's reason (the socket then
    gets one datagram per receive call, as before)."""
    try:
        sock.setsockopt(_SOL_UDP, UDP_GRO, 1)
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"
    return ""


def enable_stamps(sock: socket.socket) -> str:
    """Ask for the kernel's receive time of each datagram (SO_TIMESTAMPNS); "" when granted,
    else the kernel's reason."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"
    return ""


def receive_facts(ancdata: list[tuple[int, int, bytes]], nbytes: int) -> tuple[int, float]:
    """`segment_size`, and when the kernel received the datagrams (time.time()'s clock; 0.0
    when it did not say)."""
    size, stamped = nbytes, 0.0
    for level, kind, data in ancdata:
        if level == _SOL_UDP and kind == UDP_GRO and len(data) >= 2:
            got = int.from_bytes(data[:4] if len(data) >= 4 else data[:2], sys.byteorder)
            if got > 0:
                size = got
        elif (level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS
              and len(data) >= _TIMESPEC.size):
            seconds, nanoseconds = _TIMESPEC.unpack_from(data)
            stamped = seconds + nanoseconds * 1e-9
    return size, stamped


def segment_size(ancdata: list[tuple[int, int, bytes]], nbytes: int) -> int:
    """The size of each datagram in a receive of `nbytes` (the last may be shorter): the
    kernel's UDP_GRO control message says, when it coalesced several; else one datagram."""
    return receive_facts(ancdata, nbytes)[0]


def by_destination(sends: Sequence[Send]) -> Sequence[Send]:
    """`sends` with each destination's datagrams together, in the order each destination
    first appears, and each destination's own in their order.

    A burst's results to a job's group leave in GSO sends of consecutive datagrams to one
    destination. On a lossy network a burst mixes other datagrams in among them: a PENDING
    to a rank that asked, a result resent to one, a MISSING notice. Each would end the group's
    send there and start another, so the results left in more, smaller sends, each a receive
    call of its own at every worker (bench.loss at 1%: 4.1 datagrams per worker receive
    against 6.3 lossless). The order between destinations carries nothing: each is another
    receiver, or another socket of one (a worker's unicast socket and its group's)."""
    if not sends:
        return sends
    first = sends[0].dest
    for send in sends:
        if send.dest != first:
            break
    else:
        return sends  # one destination: a lossless burst's results, nearly always
    grouped: dict[Address, list[Send]] = {}
    for send in sends:
        grouped.setdefault(send.dest, []).append(send)
    return [send for group in grouped.values() for send in group]


Buffer = bytes | bytearray | memoryview


class DatagramBatcher:
    """Queue datagrams; consecutive ones to the same destination with the same size (the last
    may be shorter) leave in one GSO `sendmsg`. Call `flush` before waiting for anything."""

    def __init__(self, sock: socket.socket, *, gso: bool = True) -> None:
        self.sock = sock
        self.gso = gso
        self._iov: list[Buffer] = []
        self._dest: Address | None = None
        self._size = 0
        self._bytes = 0
        self._count = 0
        self._closed_group = False  # a shorter last segment ends the group
        self.datagrams_sent = 0
        self.bytes_sent = 0
        self.send_errors = 0
        self.last_error: OSError | None = None
        self.gso_refused = ""  # why the kernel refused UDP_SEGMENT, once it has
        # Destinations whose route is narrower than our datagrams: the kernel segments only
        # datagrams that fit one frame (EMSGSIZE), while one sent alone leaves as IP fragments.
        self._unsegmentable: set[Address] = set()

    def take_counts(self) -> tuple[int, int, int]:
        """(datagrams, bytes, failed datagrams) since the last call."""
        counts = (self.datagrams_sent, self.bytes_sent, self.send_errors)
        self.datagrams_sent = self.bytes_sent = self.send_errors = 0
        return counts

    def add_all(self, datagrams: Iterable[tuple[Address, Buffer, Buffer]]) -> None:
        """`add` for each (destination, header, payload) in turn: a turn's sends in one call,
        `add`'s rules spelled out once for all of them (a worker's path, per segment)."""
        unsegmentable = self._unsegmentable
        iov = self._iov
        for dest, header, payload in datagrams:
            size = len(header) + len(payload)
            count = self._count
            if count and (dest != self._dest or self._closed_group or size > self._size
                          or count >= _MAX_GSO_SEGMENTS or self._bytes + size > _MAX_GSO_BYTES
                          or not self.gso):
                self.flush()
                iov = self._iov
                count = 0
            if not count:
                self._dest, self._size = dest, size
                self._closed_group = dest in unsegmentable  # then one datagram per call
            elif size < self._size:
                self._closed_group = True
            iov += (header, payload)
            self._bytes += size
            self._count = count + 1

    def add(self, dest: Address, header: bytes | bytearray | memoryview,
            payload: bytes | bytearray | memoryview) -> None:
        size = len(header) + len(payload)
        if self._count and not (
            self.gso and dest == self._dest and not self._closed_group and size <= self._size
            and self._count < _MAX_GSO_SEGMENTS and self._bytes + size <= _MAX_GSO_BYTES
        ):
            self.flush()
        if not self._count:
            self._dest, self._size = dest, size
            if dest in self._unsegmentable:
                self._closed_group = True  # nothing joins it: one datagram per call
        elif size < self._size:
            self._closed_group = True
        self._iov.append(header)
        self._iov.append(payload)
        self._bytes += size
        self._count += 1

    def flush(self) -> None:
        if not self._count:
            return
        assert self._dest is not None
        iov, dest, count, size = self._iov, self._dest, self._count, self._size
        try:
            if count == 1:
                sent = self.sock.sendmsg(iov, (), 0, dest)
            else:
                sent = self._send_gso(iov, dest, size, count)
            self.datagrams_sent += count
            self.bytes_sent += sent
        except OSError as exc:
            # Counted, not raised: a lost send is recovered by retransmission like any loss.
            # Callers that must tell a dead route from a full queue look at `last_error`.
            self.send_errors += count
            self.last_error = exc
        finally:
            self._iov = []
            self._count = self._bytes = 0
            self._dest = None
            self._closed_group = False

    def _send_gso(self, iov: list[bytes | bytearray | memoryview], dest: Address, size: int,
                  count: int) -> int:
        try:
            return self.sock.sendmsg(iov, [(_SOL_UDP, UDP_SEGMENT, _SIZE.pack(size))], 0, dest)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:  # this route only: others may still segment
                self._unsegmentable.add(dest)
                self.gso_refused = (
                    f"EMSGSIZE: datagrams of {size} bytes are wider than the route to "
                    f"{dest[0]}:{dest[1]} carries in one frame; sent one per call, as IP "
                    "fragments")
            elif exc.errno in _GSO_UNSUPPORTED:
                self.gso_refused = (
                    f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}")
                self.gso = False  # this kernel cannot segment: one datagram per call from now
            else:
                raise
        return sum(self.sock.sendmsg(iov[i:i + 2], (), 0, dest) for i in range(0, len(iov), 2))


class UdpCoreTransport:
    """A data-plane core's UDP socket: coalesced receives (UDP GRO) cut into receive-pool
    buffers, or where the kernel refuses GRO one `recvmsg_into` per datagram straight into a
    buffer; results sent in GSO batches."""

    idle_block_s = 0.05  # the socket wakes the loop's select: this only bounds mailbox latency

    def __init__(self, sock: socket.socket, *, gro: bool = True, why_not: str = "",
                 watch: IcmpWatch | str | None = None) -> None:
        self.sock = sock
        self.batcher = DatagramBatcher(sock)
        # Which ports ICMP says are closed behind our datagrams (dataplane.reach), or why they
        # cannot be watched (None, "": not asked).
        self.watch = watch if isinstance(watch, IcmpWatch) else None
        self.watch_refused = watch if isinstance(watch, str) else ""
        # Why receives are not coalesced ("" when they are): the kernel's refusal, or ours.
        self.gro_refused = enable_gro(sock) if gro else (why_not or "turned off")
        self._staging = [Staging(GRO_BUFFER) for _ in range(_STAGING_BUFFERS)]
        self.coalesced = 0  # receive calls that carried more than one datagram

    @classmethod
    def open(cls, cfg: CoreConfig) -> UdpCoreTransport:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            enlarge_buffers(sock, _CORE_SOCKET_BUFFER)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, cfg.multicast_ttl)
            # Workers on the appliance's own host (loopback labs) must hear the multicast too.
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, int(cfg.multicast_loop))
            # Data traffic carries its class so switches can queue it apart (see steering.py).
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, cfg.tos)
            if cfg.multicast_interface:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                                socket.inet_aton(cfg.multicast_interface))
            _bind(sock, cfg.bind)
            watch = IcmpWatch.open(sock.getsockname())
        except BaseException:
            sock.close()
            raise
        # A coalesced receive needs up to GRO_SEGMENTS free buffers at once, and only pools
        # of 2 x GRO_SEGMENTS or more keep that many out of deterministic jobs' reach (see
        # slots.receive_reserve): a smaller pool could wait for buffers that never come back.
        if cfg.rx_buffers < 2 * GRO_SEGMENTS:
            return cls(sock, gro=False, why_not=f"dataplane.rx_buffers {cfg.rx_buffers} is "
                                                f"below {2 * GRO_SEGMENTS}", watch=watch)
        return cls(sock, watch=watch)

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self, pool: RxPool, batch: RxBatch, limit: int) -> int:
        batch.clear()
        if self.gro_refused:
            return self._receive_one_by_one(pool, batch, limit)
        recv = self.sock.recvmsg_into
        # Each coalesced receive stays in a staging buffer of its own, for the aggregator to
        # take whole (dataplane.runs) or copy apart; what finds no staging buffer or, for the
        # one-by-one path, no free receive buffers waits in the kernel's queue.
        for staging in self._staging:
            if batch.count >= limit or pool.free < GRO_SEGMENTS:
                break
            try:
                nbytes, ancdata, flags, source = recv([staging.buffer], GRO_CMSG_SPACE,
                                                      socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if flags & socket.MSG_TRUNC:  # cannot happen below 64 KB; counted if it does
                batch.truncated += 1
                batch.bytes += nbytes
                continue
            size = segment_size(ancdata, nbytes) if ancdata else nbytes
            if size < nbytes:
                self.coalesced += 1
            batch.add_run(staging, nbytes, size, source)
        return batch.count

    def _receive_one_by_one(self, pool: RxPool, batch: RxBatch, limit: int) -> int:
        recv = self.sock.recvmsg_into
        views = pool.views
        for _ in range(limit):
            index = pool.take()
            if index is None:
                break
            try:
                nbytes, _, flags, source = recv([views[index]], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pool.release(index)
                break
            if flags & socket.MSG_TRUNC:
                pool.release(index)
                batch.truncated += 1
                batch.bytes += nbytes
                continue
            batch.add(index, nbytes, source)
        return batch.count

    def send(self, sends: Sequence[Send]) -> None:
        batcher = self.batcher
        for send in by_destination(sends):
            batcher.add(send.dest, send.header, send.payload)
        batcher.flush()

    def take_counts(self) -> TransportCounts:
        sent, nbytes, errors = self.batcher.take_counts()
        return TransportCounts(sent, nbytes, errors)

    def fallbacks(self) -> tuple[str, ...]:
        found = []
        if refused := self.batcher.gso_refused:
            found.append(f"UDP GSO refused by the kernel ({refused}): one sendmsg per result "
                         "datagram" if not self.batcher.gso else
                         f"UDP GSO refused for a route ({refused})")
        if self.gro_refused:
            found.append(f"UDP GRO off ({self.gro_refused}): one receive call per "
                         "contribution")
        if self.watch_refused:
            found.append(f"closed ports not watched: {self.watch_refused}")
        return tuple(found)

    def closed_ports(self) -> list[Address] | None:
        return None if self.watch is None else self.watch.take()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.sock.close()


def _bind(sock: socket.socket, address: Address) -> None:
    """Bind a core's socket; a refusal is the config's to fix, said in its terms (a bare
    EADDRINUSE from a core named neither the address nor the keys that chose it)."""
    try:
        sock.bind(address)
    except OSError as exc:
        hint = {errno.EADDRINUSE: ": another reductiond, or another service, has it (stop that "
                                  "or choose another dataplane.base_port)",
                errno.EADDRNOTAVAIL: ": no interface of this host has that address"
                }.get(exc.errno or 0, "")
        raise ConfigError(f"cannot receive on {address[0]}:{address[1]} (dataplane.address, "
                          f"dataplane.base_port + the core's index): {exc.strerror or exc}"
                          f"{hint}") from exc
