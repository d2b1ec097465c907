"""The transport seam of a data-plane core, and an in-memory network for tests.

A core's poll loop drives one `CoreTransport` and knows nothing else about the network::

    received = transport.receive(pool, batch, limit)   # datagrams land in receive buffers
    sends = aggregator.on_batch(batch, now)            # sans-I/O decisions
    transport.send(sends)                              # results, resends, notices

`receive` fills an `RxBatch`: per datagram, the receive-pool buffer it landed in (header and
payload, contiguous: see slots.RxPool), its length, and its source. Ownership of those buffers
passes to the aggregator, which gives each back to the pool unless it keeps it (deterministic
mode holds early ranks' buffers). The UDP transport is `dataplane.udp.UdpCoreTransport`; the
worker side has the same seam in `plugin.transport`.

`MemoryNetwork` carries datagrams between in-memory endpoints on a simulated clock, with
faults chosen by the caller (drop, duplicate, delay): tests run the real loop and the real
client over it without sockets or sleeps.
"""

from __future__ import annotations

import heapq
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from .slots import RxPool

__all__ = [
    "Address",
    "CoreTransport",
    "MemoryEndpoint",
    "MemoryNetwork",
    "RxBatch",
    "Send",
    "TransportCounts",
]

Address = tuple[str, int]


class Send(NamedTuple):
    """One datagram to transmit: header then payload, gathered by the transport."""

    dest: Address
    header: bytes | bytearray | memoryview
    payload: memoryview | bytes


@dataclass
class TransportCounts:
    """What a transport did since it was last asked (single writer: the core's loop)."""

    datagrams_sent: int = 0
    bytes_sent: int = 0
    send_errors: int = 0


class RxBatch:
    """The datagrams of one receive call, in receive-pool buffers (reused from call to call)."""

    __slots__ = ("bytes", "count", "index", "nbytes", "source", "truncated")

    def __init__(self) -> None:
        self.index: list[int] = []  # receive-pool buffer holding datagram i
        self.nbytes: list[int] = []  # its length, header included
        self.source: list[Address] = []
        self.count = 0
        self.bytes = 0  # sum of nbytes, truncated datagrams included
        self.truncated = 0  # datagrams longer than a buffer: dropped by the transport

    def clear(self) -> None:
        self.index.clear()
        self.nbytes.clear()
        self.source.clear()
        self.count = self.bytes = self.truncated = 0

    def add(self, index: int, nbytes: int, source: Address) -> None:
        self.index.append(index)
        self.nbytes.append(nbytes)
        self.source.append(source)
        self.count += 1
        self.bytes += nbytes


class CoreTransport(Protocol):
    """What a data-plane core's loop needs from its network."""

    #: the longest an idle loop may block before receiving again (a transport whose fileno()
    #: is -1 has no descriptor that wakes it)
    idle_block_s: float

    def fileno(self) -> int:
        """A descriptor that select() reports readable when datagrams wait (-1: none)."""
        ...

    def receive(self, pool: RxPool, batch: RxBatch, limit: int) -> int:
        """Receive up to `limit` datagrams without blocking, each into a buffer taken from
        `pool`, recorded in `batch` (cleared first). Returns how many arrived."""
        ...

    def send(self, sends: Sequence[Send]) -> None:
        """Transmit, batching where the transport can; failures are counted, never raised."""
        ...

    def take_counts(self) -> TransportCounts:
        ...

    def fallbacks(self) -> tuple[str, ...]:
        """What this transport gave up for lack of support here (a GSO the kernel refused),
        each with why: the core reports them and the daemon logs each once."""
        ...

    def close(self) -> None:
        ...


# ---- in memory -----------------------------------------------------------------------------

Faults = Callable[[Address, Address, bytes], Sequence[float]]


def no_faults(source: Address, dest: Address, datagram: bytes) -> Sequence[float]:
    """Deliver every datagram once, without delay."""
    return (0.0,)


class MemoryNetwork:
    """Datagrams between `MemoryEndpoint`s on a simulated clock.

    `faults(source, dest, datagram)` returns one delay per copy to deliver: () drops it, two
    entries duplicate it, different delays reorder. Multicast groups are addresses that
    endpoints `join`; a datagram sent to a group reaches every member (each copy faulted
    independently, like the fan-out of a real switch). `tap(source, dest, datagram)`, when
    given, sees every datagram sent (a test's eavesdropper).
    """

    def __init__(self, faults: Faults = no_faults,
                 tap: Callable[[Address, Address, bytes], None] | None = None) -> None:
        self.now = 0.0
        self.faults = faults
        self.tap = tap
        self._endpoints: dict[Address, MemoryEndpoint] = {}
        self._groups: dict[Address, set[Address]] = {}
        self._in_flight: list[tuple[float, int, Address, Address, bytes]] = []
        self._seq = 0

    def clock(self) -> float:
        return self.now

    def bind(self, address: Address) -> MemoryEndpoint:
        if address in self._endpoints:
            raise OSError(f"{address} is in use")
        endpoint = MemoryEndpoint(self, address)
        self._endpoints[address] = endpoint
        return endpoint

    def join(self, group: Address, member: Address) -> None:
        self._groups.setdefault(group, set()).add(member)

    def _forget(self, address: Address) -> None:
        self._endpoints.pop(address, None)
        for members in self._groups.values():
            members.discard(address)

    def transmit(self, source: Address, dest: Address, datagram: bytes) -> None:
        if self.tap is not None:
            self.tap(source, dest, datagram)
        for member in sorted(self._groups.get(dest, {dest})):
            for delay in self.faults(source, member, datagram):
                self._seq += 1
                heapq.heappush(self._in_flight,
                               (self.now + delay, self._seq, member, source, datagram))

    def next_arrival(self) -> float:
        return self._in_flight[0][0] if self._in_flight else float("inf")

    def advance(self, to: float) -> None:
        """Move the clock to `to` (never back) and deliver what has arrived by then."""
        self.now = max(self.now, to)
        while self._in_flight and self._in_flight[0][0] <= self.now:
            _, _, dest, source, datagram = heapq.heappop(self._in_flight)
            endpoint = self._endpoints.get(dest)
            if endpoint is not None:  # nobody bound there: lost, like ICMP port unreachable
                endpoint.deliver(datagram, source)


class MemoryEndpoint:
    """One bound address on a `MemoryNetwork`: a queue of received datagrams, and a pipe that
    select() sees readable while the queue is not empty."""

    def __init__(self, net: MemoryNetwork, address: Address) -> None:
        self.net = net
        self.address = address
        self._queue: deque[tuple[bytes, Address]] = deque()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)

    def fileno(self) -> int:
        return self._rfd

    def deliver(self, datagram: bytes, source: Address) -> None:
        if not self._queue:
            os.write(self._wfd, b"!")
        self._queue.append((datagram, source))

    def sendto(self, datagram: bytes, dest: Address) -> None:
        self.net.transmit(self.address, dest, bytes(datagram))

    def recv(self) -> tuple[bytes, Address] | None:
        if not self._queue:
            return None
        item = self._queue.popleft()
        if not self._queue:
            os.read(self._rfd, 1)
        return item

    def close(self) -> None:
        if self._rfd >= 0:
            os.close(self._rfd)
            os.close(self._wfd)
            self._rfd = self._wfd = -1
            self.net._forget(self.address)


class MemoryCoreTransport:
    """`CoreTransport` over a `MemoryEndpoint`."""

    idle_block_s = 0.05

    def __init__(self, endpoint: MemoryEndpoint) -> None:
        self.endpoint = endpoint
        self._counts = TransportCounts()

    def fileno(self) -> int:
        return self.endpoint.fileno()

    def receive(self, pool: RxPool, batch: RxBatch, limit: int) -> int:
        batch.clear()
        while batch.count < limit:
            index = pool.take()
            if index is None:
                break
            got = self.endpoint.recv()
            if got is None:
                pool.release(index)
                break
            datagram, source = got
            view = pool.views[index]
            if len(datagram) > len(view):
                pool.release(index)
                batch.truncated += 1
                batch.bytes += len(datagram)
                continue
            view[:len(datagram)] = datagram
            batch.add(index, len(datagram), source)
        return batch.count

    def send(self, sends: Sequence[Send]) -> None:
        for send in sends:
            datagram = bytes(send.header) + bytes(send.payload)
            self.endpoint.sendto(datagram, send.dest)
            self._counts.datagrams_sent += 1
            self._counts.bytes_sent += len(datagram)

    def take_counts(self) -> TransportCounts:
        counts, self._counts = self._counts, TransportCounts()
        return counts

    def fallbacks(self) -> tuple[str, ...]:
        return ()

    def close(self) -> None:
        self.endpoint.close()
