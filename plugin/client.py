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
import math
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

from .pipeline import Outcome, RoundPipeline
from .rendezvous import JobInfo
from .session import Endpoint, RttEstimator, Timing, Transmit

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
    and the multicast group is joined on it. `lanes` > 1 splits the job's slots so that up to
    that many rounds (`start`) are on the wire at once (see plugin/pipeline.py); every rank of
    the job must use the same number. One thread drives a client (`allreduce`, `wait`,
    `progress`); it is not thread-safe.
    """

    def __init__(
        self,
        jobs: list[JobInfo],
        rank: int,
        *,
        local_address: str = "0.0.0.0",
        timing: Timing | None = None,
        lanes: int = 1,
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
        self.pipeline = RoundPipeline(self.endpoints, rank, self.world_size, self.segment_bytes,
                                      self.rtt, lanes)
        self.retransmissions = 0
        self._views: dict[int, memoryview] = {}  # round -> the bytes of its caller's array
        self._unclaimed: list[Outcome] = []
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

    def abandon(self, reason: str) -> list[Outcome]:
        """End every queued and in-flight round at once with `ReductionError(reason)`; their
        arrays are no longer written. Returns their outcomes."""
        outcomes = self.pipeline.fail_all(ReductionError(reason))
        for view in self._views.values():
            view.release()
        self._views.clear()
        return outcomes

    def close(self) -> None:
        """Close the sockets; rounds still queued or in flight end with a `ReductionError`."""
        if self._sockets:
            self._unclaimed.extend(
                self.abandon("the appliance client was closed during the allreduce"))
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
        if not array.flags.c_contiguous or not array.flags.writeable:
            staged = np.ascontiguousarray(array)
            self.allreduce(staged, op)
            array[...] = staged
            return array
        self.wait(self.start(array, op))
        return array

    def start(self, array: NDArray[Any], op: str | Op = "sum") -> int:
        """Queue an in-place allreduce of `array` (contiguous, writable, left untouched by the
        caller until it finishes) and return its round number; `progress` or `wait` run it.
        With several lanes, up to `lanes` rounds are on the wire at once."""
        dtype = dtype_of(array)
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ReductionError("start() needs a contiguous, writable array "
                                 "(allreduce() stages any other)")
        round_no = self.pipeline.submit(dtype, op_of(op), array.nbytes)
        self._views[round_no] = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        return round_no

    def wait(self, round_no: int) -> None:
        """Drive the rounds until `round_no` is done; raise its error if it failed. Outcomes
        of other rounds that end meanwhile are kept for the next `progress`."""
        while True:
            for outcome in self._unclaimed:
                if outcome.round == round_no:
                    self._unclaimed.remove(outcome)
                    if outcome.error is not None:
                        raise outcome.error
                    return
            if round_no not in self._views:
                raise ReductionError(f"round {round_no} was never started on this client")
            ended = self.progress()  # (it takes the unclaimed list over: extend after)
            self._unclaimed.extend(ended)

    def progress(self, timeout: float | None = None,
                 wake: socket.socket | None = None) -> list[Outcome]:
        """One turn of the transport: send what is due, wait for datagrams (at most until the
        next retransmission, `timeout`, or until `wake` is readable; forever when idle with
        neither), take them in. Returns the rounds that ended."""
        pipeline = self.pipeline
        self._send_due()
        wait = pipeline.wakeup() - time.monotonic()
        if timeout is not None:
            wait = min(wait, timeout)
        sockets = self._sockets if wake is None else [*self._sockets, wake]
        readable, _, _ = select.select(sockets, [], [], None if wait == math.inf else max(0, wait))
        for s in readable:
            if s is not wake:
                self._drain(s)
        self._send_due()  # results just stored released their slots' next segments
        outcomes = [*self._unclaimed, *pipeline.finished()]
        self._unclaimed = []
        for outcome in outcomes:
            view = self._views.pop(outcome.round, None)
            if view is not None:
                view.release()
                self.retransmissions += outcome.retransmissions
        return outcomes

    def _send_due(self) -> None:
        batcher = self._batcher
        endpoints = self.endpoints
        views = self._views
        # Group by endpoint so consecutive segments to one core leave in one GSO send.
        for t in sorted(self.pipeline.due(time.monotonic()), key=_by_endpoint):
            h = t.header
            batcher.add_header(endpoints[t.endpoint].address, h,
                               views[h.round][h.offset:h.offset + h.length])
        batcher.flush()
        error = batcher.last_error
        if error is not None and error.errno not in _TRANSIENT:
            raise ReductionError(f"cannot send to the appliance from "
                                 f"{self.sock.getsockname()[0]}: {error}") from error

    def _drain(self, sock: socket.socket) -> None:
        pipeline = self.pipeline
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
            wanted = (pipeline.accept(h) if h is not None and size == HEADER_SIZE + h.length
                      else None)
            if wanted is None or h is None:
                # Not wanted (a duplicate, an old round, a PENDING): take it off the queue.
                got = sock.recv_into(self._scratch, len(self._scratch), flags)
                if h is not None and h.kind is Kind.PENDING and got >= HEADER_SIZE:
                    pipeline.on_pending(h, bytes(self._scratch[HEADER_SIZE:got]))
                elif h is not None and h.kind is Kind.ABORTED:
                    pipeline.on_aborted(h)
                continue
            rnd, k = wanted
            offset = h.offset
            sock.recvmsg_into([peek, self._views[h.round][offset:offset + h.length]], 0, flags)
            pipeline.stored(rnd, k, time.monotonic())
