"""A worker's side of UD multicast results: join the job's group through rdma_cm, take each
core's result chunks (`dataplane.verbs.ChunkTag`) and put them back together.

A core sends each result once, to the group, as chunks of the path MTU; chunk 0 starts with the
result's header, which tells the whole length. Every chunk is copied from its receive buffer
into the core's assembly entry for its slot at its place, and a bitmap counts what came; a
result is handed on when all its chunks are in. UD loses datagrams: a result with a chunk
missing is never handed on, so the client's retransmission timer asks the core (a QUERY over
the worker's queue pair), which writes the whole result into the landing entry: that is the
repair path, and the client counts it as a retransmission.

Entries are assembled apart from the landing entries: a repair write of a slot's last result
may still be on its way when the next use's chunks arrive. Chunks of a use other than the one
being assembled start that use afresh (a late chunk of the one before is dropped when it
finds its use already handed on).

pyverbs 44 has no `ibv_attach_mcast`: the join goes through an rdma_cm identifier, whose
context and protection domain the receive buffers then have to use.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reduction_appliance.dataplane.errors import PeerError, ReductionError
from reduction_appliance.dataplane.transport import Address
from reduction_appliance.dataplane.verbs import GRH_BYTES, ChunkTag, enums
from reduction_appliance.dataplane.wire import HEADER_SIZE, Header, unpack

__all__ = ["MulticastReceiver"]

JOIN_TIMEOUT_S = 30.0  # rdma_cm answers a join at once on RoCE (no subnet manager to ask)


@dataclass
class _Assembly:
    use: int = -1  # the 4 bits of the use being assembled (-1: none yet)
    done: bool = False  # handed on: further chunks of this use are duplicates
    bits: int = 0  # chunks received
    count: int = 0
    chunks: int = 0  # how many the result has (0: chunk 0 not yet in)


@dataclass
class _Source:
    address: Address  # the core's address, as the client knows it
    entries: list[memoryview]
    slots: list[_Assembly] = field(default_factory=list)


class MulticastReceiver:
    """Joins `group` from `ip`; `sources` maps each core's UD queue-pair number to its address
    and slot count. `mtu` is the chunk size; `stride` an assembly entry's (header + segment)."""

    def __init__(self, ip: str, group: str, mtu: int, stride: int,
                 sources: dict[int, tuple[Address, int]], *, depth: int = 1024) -> None:
        import pyverbs.cm_enums as ce
        from pyverbs.cmid import CMID, AddrInfo, CMEventChannel
        from pyverbs.cq import CQ
        from pyverbs.mr import MR
        from pyverbs.qp import QPCap, QPInitAttr
        from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr
        from pyverbs.wr import SGE, RecvWR

        e = enums()
        self.group = group
        self.mtu = mtu
        self.chunks_in = 0
        self.results = 0
        self._e = e
        self._pending: list[Any] = []
        # Undone in list order: leave the group, destroy the identifier (and its QP), then
        # what the QP used, the event channel last.
        self._closers: list[Callable[[], None]] = []
        try:
            opened = _rdma_cm_fds()
            self._channel = CMEventChannel()
            self._closers.append(self._channel.close)
            _nonblocking(_rdma_cm_fds() - opened)
            self._cm = CMID(creator=self._channel, port_space=ce.RDMA_PS_UDP)
            self._closers.insert(0, self._cm.close)
            self._cm.bind_addr(AddrInfo(src=ip, port_space=ce.RDMA_PS_UDP))
            self._cm.resolve_addr(AddrInfo(src=ip, dst=group, port_space=ce.RDMA_PS_UDP))
            self._expect(ce.RDMA_CM_EVENT_ADDR_RESOLVED, "resolve the group")
            pd = self._cm.pd
            self._cq = CQ(self._cm.context, depth + 16, None, None, 0)
            self._closers.insert(1, self._cq.close)  # after the identifier (its QP uses it)
            self._srq = SRQ(pd, SrqInitAttr(SrqAttr(max_wr=depth, max_sge=1)))
            self._closers.insert(1, self._srq.close)
            self._cm.create_qp(QPInitAttr(qp_type=e.IBV_QPT_UD, scq=self._cq, rcq=self._cq,
                                          srq=self._srq,
                                          cap=QPCap(max_send_wr=1, max_recv_wr=0,
                                                    max_recv_sge=1)))
            entry = (GRH_BYTES + mtu + 63) // 64 * 64
            self._map = mmap.mmap(-1, depth * entry)
            base = int(np.frombuffer(self._map, np.uint8).ctypes.data)
            self._mr = MR(pd, depth * entry, e.IBV_ACCESS_LOCAL_WRITE, address=base)
            self._closers.insert(1, self._mr.close)
            self._views = [memoryview(self._map)[i * entry + GRH_BYTES:(i + 1) * entry]
                           for i in range(depth)]
            self._wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(base + i * entry, entry,
                                                           self._mr.lkey)])
                         for i in range(depth)]
            for wr in self._wrs:
                self._srq.post_recv(wr)
            self._cm.join_multicast(addr=AddrInfo(src=group, port_space=ce.RDMA_PS_UDP))
            self._closers.insert(0, lambda: self._cm.leave_multicast(
                AddrInfo(src=group, port_space=ce.RDMA_PS_UDP)))
            self._expect(ce.RDMA_CM_EVENT_MULTICAST_JOIN, f"join multicast group {group}")
            self._memory = [mmap.mmap(-1, max(1, slots * stride))
                            for _, slots in sources.values()]
            self._sources = {
                qpn: _Source(address, [memoryview(m)[i * stride:(i + 1) * stride]
                                       for i in range(slots)],
                             [_Assembly() for _ in range(slots)])
                for (qpn, (address, slots)), m in zip(sources.items(), self._memory,
                                                       strict=True)}
        except BaseException:
            self.close()
            raise

    def _expect(self, event_type: int, what: str) -> None:
        """The next rdma_cm event, which must be `event_type`; never waits past the timeout
        (the channel is non-blocking: pyverbs 44 would wait in C, holding the GIL)."""
        from pyverbs.cmid import CMEvent

        give_up = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            try:
                event = CMEvent(self._channel)
                break
            except Exception as exc:  # EAGAIN: nothing yet
                if time.monotonic() > give_up:
                    raise ReductionError(f"RoCE multicast: could not {what} in "
                                         f"{JOIN_TIMEOUT_S:.0f} s ({exc})") from exc
                time.sleep(0.005)
        try:
            if event.event_type != event_type:
                raise ReductionError(f"RoCE multicast: could not {what} ({event.event_str()})")
        finally:
            event.ack_cm_event()

    def poll(self) -> int:
        """Poll the completion queue; what came waits for `take`. Returns how many came."""
        npolled, wcs = self._cq.poll(64)
        if npolled:
            self._pending.extend(wcs)
        return int(npolled)

    def take(self, handle: Callable[[Header, memoryview, Address], None]) -> int:
        """Put the chunks polled so far in place; hand on each result that is whole."""
        wcs, self._pending = self._pending, []
        success = self._e.IBV_WC_SUCCESS
        for wc in wcs:
            index = wc.wr_id
            try:
                source = self._sources.get(wc.src_qp)
                if wc.status == success and source is not None:
                    self._chunk(source, wc.imm_data, self._views[index],
                                wc.byte_len - GRH_BYTES, handle)
            finally:
                self._srq.post_recv(self._wrs[index])
        self.chunks_in += len(wcs)
        return len(wcs)

    def _chunk(self, source: _Source, imm: int, data: memoryview, length: int,
               handle: Callable[[Header, memoryview, Address], None]) -> None:
        slot, use, chunk = ChunkTag.unpack(imm)
        if slot >= len(source.slots) or length <= 0:
            return  # not ours to take: a peer's fault, dropped
        state = source.slots[slot]
        if state.use != use:
            state.use, state.done, state.bits, state.count, state.chunks = use, False, 0, 0, 0
        bit = 1 << chunk
        if state.done or state.bits & bit:
            return
        entry = source.entries[slot]
        at = chunk * self.mtu
        if at + length > len(entry):
            return
        entry[at:at + length] = data[:length]
        state.bits |= bit
        state.count += 1
        if chunk == 0:
            try:
                h = unpack(entry)
            except PeerError:
                state.use = -1
                return
            state.chunks = -(-(HEADER_SIZE + h.length) // self.mtu)
        if state.chunks and state.count == state.chunks:
            state.done = True
            h = unpack(entry)
            self.results += 1
            handle(h, entry[HEADER_SIZE:HEADER_SIZE + h.length], source.address)

    def rebind(self, address: Address, qpn: int) -> None:
        """The core at `address` sends from a new UD queue pair (it was restarted)."""
        for old, source in list(self._sources.items()):
            if source.address == address:
                del self._sources[old]
                source.slots = [_Assembly() for _ in source.slots]
                self._sources[qpn] = source

    def close(self) -> None:
        for close in self._closers:
            with contextlib.suppress(Exception):  # the rest still has to go
                close()
        self._closers = []
        for wr in getattr(self, "_wrs", ()):
            wr.close()
        self._wrs = []


def _rdma_cm_fds() -> set[int]:
    """This process's open rdma_cm event channels (pyverbs 44 does not expose a channel's)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/infiniband/rdma_cm":
                found.add(int(name))
    return found


def _nonblocking(new: set[int]) -> int:
    """The one channel just opened, made non-blocking so that waiting for an event can end."""
    if len(new) != 1:
        raise ReductionError("RoCE multicast: cannot tell the rdma_cm event channel just opened "
                             f"({len(new)} new descriptors)")
    fd = new.pop()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    return fd
