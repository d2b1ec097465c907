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
from typing import Any, NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from .slots import RxPool
from .wire import HEADER_SIZE

__all__ = [
    "Address",
    "CoreTransport",
    "MemoryEndpoint",
    "MemoryNetwork",
    "RxBatch",
    "Send",
    "Staging",
    "TransportCounts",
    "datagram_starts",
]

Address = tuple[str, int]
_COALESCED_BYTES = 65536  # what one coalesced receive brings at most (an IPv4 datagram)
_COALESCED_DATAGRAMS = 64  # ... and how many datagrams (the kernel's UDP_GRO_CNT_MAX)
_COALESCED_RUNS = 16  # coalesced receives per burst
_REFUSALS_KEPT = 1024  # an endpoint's unread refusals at most (a sender that never asks)


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


def datagram_starts(nbytes: int, size: int) -> range:
    """Where each datagram of a receive of `nbytes` begins, given `segment_size`'s `size`.
    An empty datagram (anyone may send one) is still one datagram, at 0 (of 0 bytes), for the
    receiver to count as malformed, not a zero step that stops the receive loop."""
    return range(0, max(nbytes, 1), max(size, 1))


class Staging:
    """A transport's buffer for one coalesced receive: consecutive datagrams of one source,
    all `size` bytes long but the last (UDP GRO hands them over like that). Lent to the
    aggregator in an `RxBatch` until the transport's next receive; the aggregator reads the
    datagrams where they lie, or copies them into receive-pool buffers one by one."""

    __slots__ = ("_rows", "array", "buffer", "view")

    def __init__(self, nbytes: int) -> None:
        self.buffer = bytearray(nbytes)
        self.view = memoryview(self.buffer)
        self.array: NDArray[np.uint8] = np.frombuffer(self.buffer, np.uint8)
        self._rows: dict[tuple[int, np.dtype[Any]], NDArray[Any]] = {}

    def rows(self, size: int, storage: np.dtype[Any]) -> NDArray[Any]:
        """The payloads of datagrams `size` bytes apart as the rows of one view, in elements
        of `storage` (built once per size: a view costs as much as a small kernel call)."""
        key = (size, storage)
        rows = self._rows.get(key)
        if rows is None:
            count = len(self.buffer) // size
            rows = self.array[:count * size].reshape(count, size)[:, HEADER_SIZE:].view(storage)
            self._rows[key] = rows
        return rows


class RxBatch:
    """What one receive call brought (reused from call to call): datagrams in receive-pool
    buffers, and coalesced receives left in the transport's `Staging` buffers (runs)."""

    __slots__ = ("bytes", "count", "index", "nbytes", "runs", "source", "truncated")

    def __init__(self) -> None:
        self.index: list[int] = []  # receive-pool buffer holding datagram i
        self.nbytes: list[int] = []  # its length, header included
        self.source: list[Address] = []
        # (staging, bytes received, datagram size, source): `size`-byte datagrams back to back
        self.runs: list[tuple[Staging, int, int, Address]] = []
        self.count = 0  # datagrams, those of runs included
        self.bytes = 0  # sum of nbytes and of runs' bytes, truncated datagrams included
        self.truncated = 0  # datagrams longer than a buffer: dropped by the transport

    def clear(self) -> None:
        self.index.clear()
        self.nbytes.clear()
        self.source.clear()
        self.runs.clear()
        self.count = self.bytes = self.truncated = 0

    def add(self, index: int, nbytes: int, source: Address) -> None:
        self.index.append(index)
        self.nbytes.append(nbytes)
        self.source.append(source)
        self.count += 1
        self.bytes += nbytes

    def add_run(self, staging: Staging, nbytes: int, size: int, source: Address) -> None:
        """A coalesced receive of `nbytes` in `staging`: datagrams of `size` bytes, the last
        possibly shorter (an empty datagram is one datagram of 0 bytes)."""
        self.runs.append((staging, nbytes, size, source))
        self.count += max(1, -(-nbytes // max(size, 1)))
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

    def closed_ports(self) -> list[Address] | None:
        """The endpoints found closed (nothing listens there) since the last call, from what
        their hosts answered this transport's datagrams (dataplane.reach); None where this
        transport cannot tell."""
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
            if endpoint is not None:
                endpoint.deliver(datagram, source)
            elif (dest not in self._groups and (sender := self._endpoints.get(source))
                  and len(sender.refused) < _REFUSALS_KEPT):
                sender.refused.append(dest)  # nobody bound there: ICMP port unreachable


class MemoryEndpoint:
    """One bound address on a `MemoryNetwork`: a queue of received datagrams, and a pipe that
    select() sees readable while the queue is not empty."""

    def __init__(self, net: MemoryNetwork, address: Address) -> None:
        self.net = net
        self.address = address
        self.refused: list[Address] = []  # where its datagrams found nobody bound
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

    def recv_coalesced(self, into: bytearray) -> tuple[int, int, Address] | None:
        """Receive as a UDP socket with GRO does: the next datagrams of one source and one
        size (the last may be shorter), up to 64 of them and `len(into)` bytes, back to back
        into `into`; (bytes, datagram size, source), or None when nothing waits."""
        queue = self._queue
        if not queue:
            return None
        size, source = len(queue[0][0]), queue[0][1]
        at = count = 0
        while count < _COALESCED_DATAGRAMS and queue:
            datagram, sender = queue[0]
            if (sender != source or len(datagram) > size or at + len(datagram) > len(into)
                    or (count and (not size or at != count * size))):
                break  # another source, or a shorter (or empty) datagram ended the run
            self.recv()
            into[at:at + len(datagram)] = datagram
            at += len(datagram)
            count += 1
        return at, size, source

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
    """`CoreTransport` over a `MemoryEndpoint`. With `coalesce` (the default) it receives as a
    UDP socket with GRO does: consecutive datagrams of one source and one size (the last may
    be shorter) as one run in a staging buffer, up to 64 of them and 64 KB; else each
    datagram into a receive-pool buffer, as where the kernel refuses GRO (or over RDMA)."""

    idle_block_s = 0.05

    def __init__(self, endpoint: MemoryEndpoint, *, coalesce: bool = True) -> None:
        self.endpoint = endpoint
        self.coalesce = coalesce
        self._counts = TransportCounts()
        self._staging = [Staging(_COALESCED_BYTES) for _ in range(_COALESCED_RUNS)]

    def fileno(self) -> int:
        return self.endpoint.fileno()

    def receive(self, pool: RxPool, batch: RxBatch, limit: int) -> int:
        batch.clear()
        if self.coalesce:
            return self._receive_runs(batch, limit)
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

    def _receive_runs(self, batch: RxBatch, limit: int) -> int:
        for staging in self._staging:
            if batch.count >= limit:
                break
            got = self.endpoint.recv_coalesced(staging.buffer)
            if got is None:
                break
            batch.add_run(staging, *got)
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

    def closed_ports(self) -> list[Address] | None:
        refused, self.endpoint.refused = self.endpoint.refused, []
        return refused

    def close(self) -> None:
        self.endpoint.close()
