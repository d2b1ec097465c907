"""The RoCE transport of a worker: one RC queue pair per appliance core, behind the same seam as
UDP (`plugin.transport.WorkerTransport`).

A contribution is packed into a registered staging entry (header, then the tensor's segment:
one memcpy) and sent with a prebuilt work request as a SEND_WITH_IMM whose immediate is its
slot. Each core writes its results (RDMA WRITE_WITH_IMM) into this worker's landing buffers for
that core, one entry per slot of the job (`dataplane.verbs.Landing`, which says why that is
safe); the completion's immediate names the entry, which is handed to the client (it copies the
payload into the caller's array). Every other message (notices, PENDING, LIVENESS) is a SEND
into a small receive buffer on a shared receive queue, posted again once handled; a write's
completion takes one of those receive requests too, so their number is the flow control of
both. The address a core sees this worker at is `(its IP, a port the control plane picked)`:
what it joins with (`source_for`).

There is no descriptor to select on (pyverbs 44), so `wait` polls the completion queue with a
short backoff. A send queue that is full counts as a loss (the client's retransmission repairs
it); any error completion means the appliance is lost and the next call raises.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reduction_appliance.dataplane.errors import PeerError, ReductionError
from reduction_appliance.dataplane.transport import Address
from reduction_appliance.dataplane.verbs import (
    SEND_BYTES,
    Backoff,
    Landing,
    QpEndpoint,
    RegisteredRing,
    RingWR,
    RoceDevice,
    device_for,
    enums,
    roce_unavailable,
)
from reduction_appliance.dataplane.wire import HEADER_SIZE, peek_slot, unpack

from .rendezvous import JobInfo
from .roce_multicast import MulticastReceiver
from .transport import Handler, Outgoing, RunHandler

__all__ = ["RoceWorkerTransport", "connect_jobs", "local_roce_unavailable"]

_log = logging.getLogger(__name__)

SIGNAL_EVERY = 8
_SEND_TAG = 1 << 62


@dataclass
class _Core:
    index: int
    address: Address  # the core's (UDP) address: where the client sends
    qp: Any
    local: QpEndpoint
    ring: list[RingWR]
    first: int  # its first staging entry
    landing: RegisteredRing  # the core writes the result for slot s into entry s
    seq: int = 0
    outstanding: int = 0
    unsignalled: int = 0
    connected: bool = False
    source: Address | None = None  # the address the core knows us by (the control plane's)


class RoceWorkerTransport:
    """`WorkerTransport` over RC queue pairs (see the module docstring). `max_message` is the
    largest message: a header and the job's largest segment."""

    reliable = True  # RC: retransmitted by the NIC, or the connection is lost

    def __init__(self, device: RoceDevice, local_ip: str, max_message: int, *,
                 cores: int = 8, depth: int = 64, owns_device: bool = False) -> None:
        if depth <= SIGNAL_EVERY:
            raise ValueError(f"depth must exceed {SIGNAL_EVERY}")
        from pyverbs.wr import SGE, RecvWR

        self.device = device
        self._owns_device = owns_device
        self.local_ip = local_ip
        self.max_message = max_message
        self._depth = depth
        self._max_cores = cores
        self._e = enums()
        self._cq = device.completion_queue(4 * depth * cores + depth)
        self._srq = device.shared_receive_queue(depth)
        self._inbox = RegisteredRing(device, depth, SEND_BYTES)
        self._recv_wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(self._inbox.address(i),
                                                             self._inbox.entry_bytes,
                                                             self._inbox.lkey)])
                          for i in range(depth)]
        for wr in self._recv_wrs:
            self._srq.post_recv(wr)
        self._staging = RegisteredRing(device, cores * depth, max_message)
        self._cores: dict[Address, _Core] = {}
        self._by_qpn: dict[int, _Core] = {}
        self._lock = threading.Lock()  # the heartbeat lease sends from its own thread
        self._pending: list[Any] = []  # completions `wait` polled, for `receive`
        self._lost = ""
        self._backoff = Backoff()
        self._closed = False
        self._broken_cores: dict[Address, str] = {}  # core -> why its queue pair failed
        #: connects a core's job afresh (`connect_jobs` sets it); None: a failure is final
        self._reconnect: Callable[[Address], None] | None = None
        self.multicast: MulticastReceiver | None = None  # a job's UD multicast results

    # ---- connections ----
    def open(self, core: Address, slots: int) -> QpEndpoint:
        """A queue pair for `core`, and landing entries for its `slots` slots of the job; its
        end goes to the control plane, which answers with the core's (`connect`)."""
        if core in self._cores:
            raise ReductionError(f"the core at {core[0]}:{core[1]} is connected already (one "
                                 "RoCE job per client and appliance)")
        if len(self._cores) >= self._max_cores:
            raise ReductionError(f"this transport connects at most {self._max_cores} cores")
        index = len(self._cores)
        landing = RegisteredRing(self.device, slots, self.max_message, remote_write=True)
        try:
            qp = self.device.rc_queue_pair(self._cq, self._srq, self._depth)
        except BaseException:
            landing.close()
            raise
        local = self.device.endpoint(qp, self._landing_of(landing))
        first = index * self._depth
        ring = [RingWR(self._staging.address(first + i), 0, self._staging.lkey)
                for i in range(self._depth)]
        c = _Core(index, core, qp, local, ring, first, landing)
        self._cores[core] = c
        self._by_qpn[local.qpn] = c
        return local

    @staticmethod
    def _landing_of(ring: RegisteredRing) -> Landing:
        return Landing(ring.base, ring.rkey, ring.entries, ring.entry_bytes)

    def connect(self, core: Address, remote: QpEndpoint, source: Address) -> None:
        """Connect to the core's end; it knows this worker's messages as from `source`."""
        c = self._cores[core]
        self.device.connect(c.qp, c.local, remote)
        c.connected = True
        c.source = source

    def join_multicast(self, group: str, sources: dict[int, tuple[Address, int]],
                       chunk_bytes: int) -> None:
        """Take results from `group` too: `sources` maps each core's UD queue pair to its
        address and slot count; the cores cut results into chunks of `chunk_bytes` (their
        MTU: the MTU in their end) (`MulticastReceiver`)."""
        if self.multicast is not None:
            raise ReductionError("this transport takes one multicast group")
        stride = (self.max_message + 63) // 64 * 64
        self.multicast = MulticastReceiver(self.local_ip, group, chunk_bytes, stride, sources)

    def source_for(self, dest: Address) -> Address:
        c = self._cores.get(dest)
        if c is None or c.source is None:
            raise ReductionError(f"no RoCE connection to {dest[0]}:{dest[1]}")
        return c.source

    # ---- the seam ----
    def _staging_entry(self, c: _Core) -> int | None:
        """The next staging entry of `c`, free once its send queue has room; None when full
        or not connected (a loss: the client's timer repairs it)."""
        if not c.connected or c.outstanding >= self._depth:
            return None
        return c.first + c.seq % self._depth

    def _post(self, c: _Core, nbytes: int, slot: int = -1) -> None:
        """Send the message just staged in `c`'s next entry (selectively signalled); with a
        `slot`, as a SEND_WITH_IMM naming it (a contribution)."""
        ring = c.ring[c.seq % self._depth]
        c.seq += 1
        c.outstanding += 1
        c.unsignalled += 1
        wr_id = _SEND_TAG | c.unsignalled
        signalled = c.unsignalled >= SIGNAL_EVERY
        if signalled:
            c.unsignalled = 0
        ring.sge.length = nbytes
        wr = ring.wr
        wr.wr_id = wr_id
        wr.send_flags = self._e.IBV_SEND_SIGNALED if signalled else 0
        if slot >= 0:
            wr.opcode = self._e.IBV_WR_SEND_WITH_IMM
            wr.imm_data = slot
        else:
            wr.opcode = self._e.IBV_WR_SEND
        try:
            c.qp.post_send(ring.wr)
        except Exception as exc:  # the queue pair is gone with its peer: repaired on receive
            c.outstanding -= 1
            self._broken_cores.setdefault(c.address, (
                f"lost the RoCE connection to the appliance at {c.address[0]}:{c.address[1]} "
                f"(post_send: {exc})"))

    def send(self, datagrams: Sequence[Outgoing]) -> None:
        if self._lost:
            raise ReductionError(self._lost)
        views = self._staging.views
        with self._lock:
            for d in datagrams:
                c = self._cores.get(d.dest)
                if c is None:
                    raise ReductionError(f"no RoCE connection to {d.dest[0]}:{d.dest[1]}")
                n = len(d.payload)
                if HEADER_SIZE + n > self.max_message:
                    raise ReductionError(f"a {n}-byte segment exceeds this transport's "
                                         f"{self.max_message}-byte messages")
                entry = self._staging_entry(c)
                if entry is None:
                    continue  # a full queue: like a loss
                view = views[entry]
                view[:HEADER_SIZE] = d.header
                view[HEADER_SIZE:HEADER_SIZE + n] = d.payload
                self._post(c, HEADER_SIZE + n, peek_slot(d.header))

    def send_raw(self, datagram: bytes, dest: Address) -> None:
        with self._lock:
            c = self._cores.get(dest)
            if c is None or self._lost or len(datagram) > SEND_BYTES:
                return
            entry = self._staging_entry(c)
            if entry is not None:  # else a lost heartbeat, never raised (the seam)
                self._staging.views[entry][:len(datagram)] = datagram
                self._post(c, len(datagram))

    def _poll(self) -> int:
        npolled, wcs = self._cq.poll(64)
        if npolled:
            self._pending.extend(wcs)
        return int(npolled)

    def receive(self, handle: Handler, take_run: RunHandler | None = None) -> int:
        # Completions are whole messages, one per segment: nothing to take as a run.
        if not self._pending:
            self._poll()
        taken = 0
        if self.multicast is not None:
            self.multicast.poll()
            taken += self.multicast.take(handle)
        success = self._e.IBV_WC_SUCCESS
        written = self._e.IBV_WC_RECV_RDMA_WITH_IMM
        while self._pending:
            wcs, self._pending = self._pending, []
            for wc in wcs:
                wr_id = wc.wr_id
                c = self._by_qpn.get(wc.qp_num)  # None: a queue pair since replaced
                if wr_id >= _SEND_TAG:
                    if c is not None:
                        with self._lock:
                            c.outstanding -= wr_id & 0xFFFFF
                        if wc.status != success:
                            self._broken(c, wc)
                    continue
                try:
                    if wc.status != success:
                        if c is not None:
                            self._broken(c, wc)
                        continue
                    taken += 1
                    if c is None or wc.byte_len < HEADER_SIZE:
                        continue
                    if wc.opcode == written:  # a result, in the landing entry of its slot
                        slot = wc.imm_data
                        if slot >= c.landing.entries:
                            continue
                        view = c.landing.views[slot]
                        h = unpack(view)
                        if h.slot != slot:
                            continue
                    else:
                        view = self._inbox.views[wr_id]
                        h = unpack(view)
                    if wc.byte_len == HEADER_SIZE + h.length:
                        handle(h, view[HEADER_SIZE:wc.byte_len], c.address)
                except PeerError:
                    pass
                finally:  # the receive request goes back whatever became of its message
                    self._srq.post_recv(self._recv_wrs[wr_id])
            if self._broken_cores:
                self._repair()
            if self._lost:
                raise ReductionError(self._lost)
            self._poll()
        return taken

    def _broken(self, c: _Core, wc: Any) -> None:
        self._broken_cores.setdefault(c.address, (
            f"lost the RoCE connection to the appliance at {c.address[0]}:{c.address[1]} "
            f"(completion status {wc.status})"))

    def _repair(self) -> None:
        """Connect the broken cores' jobs afresh (a restarted core lost its queue pairs), or
        give up: the next call raises why."""
        broken, self._broken_cores = self._broken_cores, {}
        for address, why in broken.items():
            if self._lost:
                return
            if self._reconnect is None:
                self._lost = why
                return
            try:
                self._reconnect(address)
            except Exception as exc:
                self._lost = f"{why}; connecting again failed: {exc}"
                return
            _log.info("%s; connected again", why)

    def reopen(self, core: Address) -> QpEndpoint:
        """A fresh queue pair for `core` in place of its broken one (then `connect` it)."""
        c = self._cores[core]
        with self._lock:
            self._by_qpn.pop(c.local.qpn, None)
            c.qp.close()
            c.qp = self.device.rc_queue_pair(self._cq, self._srq, self._depth)
            c.local = self.device.endpoint(c.qp, self._landing_of(c.landing))
            c.seq = c.outstanding = c.unsignalled = 0
            c.connected = False
            self._by_qpn[c.local.qpn] = c
        return c.local

    def wait(self, timeout: float | None, wake: socket.socket | None = None) -> None:
        import time

        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        backoff = self._backoff
        backoff.reset()
        multicast = self.multicast
        while not self._pending:
            if self._poll() or (multicast is not None and multicast.poll()):
                backoff.reset()
                return
            if not backoff.pause(deadline, wake):
                return

    def close(self) -> None:
        """Idempotent: pyverbs 44 frees a work request's memory again on a second close."""
        if self._closed:
            return
        self._closed = True
        if self.multicast is not None:
            self.multicast.close()
        for c in self._cores.values():
            c.qp.close()
            c.landing.close()
            for wr in c.ring:
                wr.close()
        self._cores.clear()
        for wr in self._recv_wrs:
            wr.close()
        self._srq.close()
        self._cq.close()
        self._inbox.close()
        self._staging.close()
        if self._owns_device:
            self.device.close()

    def __enter__(self) -> RoceWorkerTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _local_ip(local_address: str, toward: Address) -> str:
    if local_address != "0.0.0.0":
        return local_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the route's source
        probe.connect(toward)
        return str(probe.getsockname()[0])


def local_roce_unavailable(local_address: str) -> str | None:
    """Why this worker cannot use RoCE from `local_address` ("0.0.0.0": any device), or None."""
    why = roce_unavailable()
    if why is not None or local_address == "0.0.0.0":
        return why
    if device_for(local_address) is None:
        return f"no RDMA device has {local_address} as a RoCE v2 address (GID)"
    return None


def connect_jobs(jobs: Sequence[JobInfo], rank: int, local_address: str,
                 connect: Callable[..., tuple[Address, list[dict[str, object]]]]
                 ) -> RoceWorkerTransport:
    """A transport with one queue pair per core of every (RoCE) job, connected through each
    appliance's API (`connect`: plugin.rendezvous.connect); `ReductionError` says why not."""
    ip = _local_ip(local_address, (jobs[0].cores[0].host, jobs[0].cores[0].port))
    why = roce_unavailable()
    if why is not None:
        raise ReductionError(f"job {jobs[0].name!r} runs over RoCE, but {why}")
    found = device_for(ip)
    if found is None:
        raise ReductionError(f"no RDMA device has {ip} as a RoCE v2 address (GID); pass the "
                             "worker's data address as local_address")
    name, gid_index = found
    device = RoceDevice(name, gid_index=gid_index)
    segment = max(j.segment_bytes for j in jobs)
    transport = RoceWorkerTransport(device, ip, HEADER_SIZE + segment,
                                    cores=sum(len(j.cores) for j in jobs), owns_device=True)
    job_of = {(c.host, c.port): job for job in jobs for c in job.cores}

    def reconnect(core: Address) -> None:
        """The core's job again, every core of it: the appliance replaces our queue pairs and
        keeps our address (a restarted core had lost them). Waits for a restarting core as
        long as the job's deadline allows."""
        job = job_of[core]
        cores = [(c.host, c.port) for c in job.cores]
        ours = [transport.reopen(c).as_json() for c in cores]
        source, theirs = connect(job, rank, ip, ours, timeout_s=job.deadline_s,
                                 unreachable_is_final=True)
        for c, end in zip(cores, map(QpEndpoint.from_json, theirs), strict=True):
            transport.connect(c, end, source)
            if transport.multicast is not None:
                transport.multicast.rebind(c, end.multicast_qpn)

    try:
        for job in jobs:
            cores = [(c.host, c.port) for c in job.cores]
            ours = [transport.open((c.host, c.port), c.slots).as_json() for c in job.cores]
            source, theirs = connect(job, rank, ip, ours)
            ends = [QpEndpoint.from_json(end) for end in theirs]
            for core, end in zip(cores, ends, strict=True):
                transport.connect(core, end, source)
            if job.multicast is not None:  # results come as UD multicast chunks too
                transport.join_multicast(job.multicast[0], {
                    end.multicast_qpn: (core, c.slots)
                    for core, end, c in zip(cores, ends, job.cores, strict=True)},
                    ends[0].mtu)
    except BaseException:
        transport.close()
        raise
    transport._reconnect = reconnect
    return transport
