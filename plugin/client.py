"""The numpy worker client: `allreduce(array, op="sum")` in place, through one or more appliances.

A thin UDP transport around the sans-I/O `AllreduceRound`: contributions leave with
`sendmsg([header, view])` straight from the array; results are peeked (header only), checked,
and then received with `recvmsg_into` straight into the array. Results come on the job's
multicast group (a socket bound to the group's port, shared by every worker on this host) and,
for retransmissions or unicast jobs, on the worker's own socket.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import time
from types import TracebackType
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from dataplane.errors import ReductionError
from dataplane.udp import DatagramBatcher, enlarge_buffers
from dataplane.wire import HEADER_SIZE, DType, Header, Kind, Op, WireError, unpack

from .rendezvous import JobInfo
from .session import AllreduceRound, Endpoint, RttEstimator, Timing, Transmit

__all__ = ["ApplianceClient", "dtype_of", "op_of"]


def _by_endpoint(t: Transmit) -> tuple[int, int]:
    return (t.endpoint, t.segment)

_SOCKET_BUFFER = 32 * 1024 * 1024
_TRANSIENT = {errno.ENOBUFS, errno.EAGAIN, errno.EWOULDBLOCK}  # a full queue: like a loss
_RECV_SCRATCH = 65536

_DTYPES = {
    np.dtype(np.float32): DType.FLOAT32,
    np.dtype(np.float16): DType.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): DType.BFLOAT16,
}


def dtype_of(array: NDArray[Any]) -> DType:
    try:
        return _DTYPES[array.dtype]
    except KeyError:
        raise ReductionError(
            f"the appliance reduces float32, float16 and bfloat16, not {array.dtype}"
        ) from None


def op_of(op: str | Op) -> Op:
    if isinstance(op, Op):
        return op
    try:
        return Op[op.upper()]
    except KeyError:
        raise ReductionError(f"unknown op {op!r}; choose sum, avg, min or max") from None


class ApplianceClient:
    """One rank of one job, on one or more appliances (segments are spread over all of them).

    `local_address` is this worker's address on the data network: contributions leave from it
    and the multicast group is joined on it.
    """

    def __init__(
        self,
        jobs: list[JobInfo],
        rank: int,
        *,
        local_address: str = "0.0.0.0",
        timing: Timing | None = None,
    ) -> None:
        if not jobs:
            raise ReductionError("ApplianceClient needs at least one registered job")
        world = {j.world_size for j in jobs}
        if len(world) != 1:
            raise ReductionError(f"appliances disagree on the world size: {sorted(world)}")
        self.world_size = world.pop()
        if not 0 <= rank < self.world_size:
            raise ReductionError(f"rank {rank} is outside world size {self.world_size}")
        self.rank = rank
        self.jobs = jobs
        self.endpoints: tuple[Endpoint, ...] = tuple(e for j in jobs for e in j.endpoints)
        self.segment_bytes = min(j.segment_bytes for j in jobs)
        self.rtt = RttEstimator(timing or Timing())
        self.round = 0
        self.retransmissions = 0
        self._header = bytearray(HEADER_SIZE)
        self._scratch = bytearray(_RECV_SCRATCH)
        self._sockets: list[socket.socket] = []
        with contextlib.ExitStack() as stack:
            self.sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            enlarge_buffers(self.sock, _SOCKET_BUFFER)
            self.sock.bind((local_address, 0))
            self._sockets.append(self.sock)
            self._batcher = DatagramBatcher(self.sock)
            for group in {j.multicast for j in jobs if j.multicast is not None}:
                self._sockets.append(stack.enter_context(self._join(group, local_address)))
            stack.pop_all()

    @staticmethod
    def _join(group: tuple[str, int], local_address: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            enlarge_buffers(sock, _SOCKET_BUFFER)
            # Bound to the group address: this socket hears only that group, not unicast.
            sock.bind(group)
            interface = socket.inet_aton(local_address)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton(group[0]) + interface)
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()

    def __enter__(self) -> ApplianceClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- the collective ----
    def allreduce(self, array: NDArray[Any], op: str | Op = "sum") -> NDArray[Any]:
        """Reduce `array` over all ranks in place and return it. Raises `AllreduceTimeout`
        (naming the silent appliance cores and missing ranks) instead of hanging."""
        dtype = dtype_of(array)
        if not array.flags.c_contiguous or not array.flags.writeable:
            staged = np.ascontiguousarray(array)
            self.allreduce(staged, op)
            array[...] = staged
            return array
        self.round += 1
        now = time.monotonic()
        rnd = AllreduceRound(
            self.endpoints, self.rank, self.world_size, self.round, dtype, op_of(op),
            array.nbytes, self.segment_bytes, self.rtt, now,
        )
        view = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        try:
            self._run(rnd, view)
        finally:
            view.release()
        self.retransmissions += rnd.retransmissions
        return array

    def _run(self, rnd: AllreduceRound, view: memoryview) -> None:
        batcher = self._batcher
        endpoints = self.endpoints
        while not rnd.done:
            now = time.monotonic()
            # Group by endpoint so consecutive segments to one core leave in one GSO send.
            for t in sorted(rnd.due(now), key=_by_endpoint):
                offset = t.header.offset
                batcher.add_header(endpoints[t.endpoint].address, t.header,
                                   view[offset:offset + t.header.length])
            batcher.flush()
            error = batcher.last_error
            if error is not None and error.errno not in _TRANSIENT:
                raise ReductionError(f"cannot send to the appliance from "
                                     f"{self.sock.getsockname()[0]}: {error}") from error
            timeout = max(0.0, rnd.wakeup() - time.monotonic())
            readable, _, _ = select.select(self._sockets, [], [], timeout)
            for s in readable:
                self._drain(s, rnd, view)

    def _drain(self, sock: socket.socket, rnd: AllreduceRound, view: memoryview) -> None:
        peek = self._header
        flags = socket.MSG_DONTWAIT
        while True:
            try:
                # MSG_TRUNC: the datagram's real length, so a result shorter than its header
                # claims never lands half-written in the caller's array.
                size = sock.recv_into(peek, HEADER_SIZE, socket.MSG_PEEK | socket.MSG_TRUNC | flags)
            except BlockingIOError:
                return
            try:
                h: Header | None = unpack(peek) if size >= HEADER_SIZE else None
            except WireError:
                h = None
            k = rnd.accept(h) if h is not None and size == HEADER_SIZE + h.length else None
            if k is None or h is None:
                # Not wanted (a duplicate, another round, a PENDING): take it off the queue.
                got = sock.recv_into(self._scratch, len(self._scratch), flags)
                if h is not None and h.kind is Kind.PENDING and got >= HEADER_SIZE:
                    rnd.on_pending(h, bytes(self._scratch[HEADER_SIZE:got]))
                elif h is not None and h.kind is Kind.ABORTED:
                    rnd.on_aborted(h)
                continue
            offset = h.offset
            sock.recvmsg_into([peek, view[offset:offset + h.length]], 0, flags)
            rnd.stored(k, time.monotonic())
