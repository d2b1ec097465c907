"""The RoCE transport of a data-plane core: RC queue pairs behind the same seam as UDP.

A worker's contribution (header and payload, `dataplane.wire`) arrives as one RC SEND_WITH_IMM
whose immediate is its slot: the NIC places it straight into a receive-pool buffer of the core's
slot arena, which is registered once as a memory region; the buffers are posted as prebuilt
receive work requests on one shared receive queue that every worker's queue pair uses, and every
queue pair completes into one completion queue. A completion names its queue pair, and the
queue pair the worker's endpoint address, so the aggregator sees what it sees over UDP: a
buffer, a length, a source.

A result leaves in place as one RDMA WRITE_WITH_IMM of the arena (its header sits right before
it, `SlotArena.header_before`) into the worker's landing entry for its slot (`verbs.Landing`),
the immediate naming the slot: no copy, no receive buffer of a segment's size on the worker.
Notices, PENDING, LIVENESS and small results are copied into a staging entry and SENT (at most
`verbs.SEND_BYTES`). A job that asked for multicast results has a group `(IP, ROCE_GROUP_PORT)`:
its results go once, as UD chunks of the MTU from the core's UD queue pair (`_multicast`).

The control plane connects a worker by handing `accept` the worker's `QpEndpoint` and the
address the worker joined from (`(its IP, its QP number)`); the core's end goes back to the
worker. A queue pair whose peer is gone (any error completion: retries exhausted, flushed,
remote error) is moved to ERR and forgotten: its rank falls silent and the job's liveness
timeout names it to the others, as over UDP.

RC never drops: a send queue that is full (the worker stopped taking results) counts as a send
error and the message is dropped, which the worker's retransmission repairs like a loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .counters import Counter, Counters
from .errors import ReductionError
from .slots import SlotArena, receive_reserve
from .transport import Address, RxBatch, Send, TransportCounts
from .verbs import (
    MULTICAST_QKEY,
    MULTICAST_QPN,
    SEND_BYTES,
    ChunkTag,
    Landing,
    QpEndpoint,
    RegisteredRing,
    RingWR,
    RoceDevice,
    enums,
)
from .wire import HEADER_SIZE, Kind

__all__ = ["ROCE_GROUP_PORT", "ROCE_PORTS", "RoceCoreTransport"]

#: The ports of RoCE peers' addresses `(worker IP, port)`: the control plane hands them out,
#: below 1024 so that no worker's UDP socket (an ephemeral port) can have the same address on
#: a core that serves both transports.
ROCE_PORTS = range(1, 1023)
#: the port of a RoCE job's multicast group `(group IP, ROCE_GROUP_PORT)`: results sent there go
#: as UD multicast chunks (`verbs.ChunkTag`)
ROCE_GROUP_PORT = 1023
UD_DEPTH = 4096  # chunks in flight on the core's UD queue pair (at least two largest results)

SIGNAL_EVERY = 8  # one signalled send per this many: its completion retires them all
_SEND_TAG = 1 << 62  # wr_id of a send: tag | sends it retires (of a receive: its buffer)
_KIND_AT = 3  # header byte offsets (dataplane.wire): the kind, and the slot (4 bytes)
_SLOT_AT = slice(28, 32)
_USE_AT = slice(44, 48)


@dataclass
class _Peer:
    index: int
    address: Address
    qp: Any
    local: QpEndpoint
    remote: QpEndpoint
    ring: list[RingWR]
    staging: int  # first staging entry of this peer
    seq: int = 0
    outstanding: int = 0  # sends posted and not yet retired by a signalled completion
    unsignalled: int = 0
    lost: str = ""  # why the peer is gone ("" while connected)


class RoceCoreTransport:
    """`CoreTransport` over RC queue pairs on one device (see the module docstring)."""

    #: no descriptor turns readable on a completion: an idle loop blocks at most this long
    #: between polls (a completion waits up to that long when the core was idle briefly; after
    #: seconds of silence, up to the loop's mailbox bound: dataplane/spin.py's IdleBlocks)
    idle_block_s = 0.002

    def __init__(self, device: RoceDevice, arena: SlotArena, counters: Counters, *,
                 peers: int = 64, send_depth: int = 64, completion_depth: int = 8192) -> None:
        if send_depth <= SIGNAL_EVERY:
            raise ValueError(f"send_depth must exceed {SIGNAL_EVERY}")
        self.device = device
        self.arena = arena
        self._cells = counters.cells  # the ROCE_* counters (one writer: this core's loop)
        self._transport_counts = TransportCounts()
        self._send_depth = send_depth
        self._max_peers = peers
        pool = arena.rx
        self._mr = device.register(arena.address, arena.nbytes)
        self._lkey = int(self._mr.lkey)
        self._cq = device.completion_queue(completion_depth)
        # A pool buffer posted for receive belongs to the transport until its completion; at
        # most the buffers never held for deterministic jobs are posted at once, so holds
        # (slots.holdable_buffers) and posted receives never compete for the same buffers.
        self._recv_depth = receive_reserve(len(pool))
        self._srq = device.shared_receive_queue(self._recv_depth)
        from pyverbs.wr import SGE, RecvWR

        self._recv_wrs = [RecvWR(wr_id=i, num_sge=1,
                                 sg=[SGE(pool.addresses[i], pool.buffer_bytes, self._lkey)])
                          for i in range(len(pool))]
        self._posted = 0
        self._staging = RegisteredRing(device, peers * send_depth, SEND_BYTES)
        self._peers: dict[int, _Peer] = {}  # by local QP number
        self._by_address: dict[Address, _Peer] = {}
        self._free_index = list(range(peers - 1, -1, -1))
        self._arena_end = arena.address + arena.nbytes
        self._e = enums()
        from pyverbs.wr import SGE as _SGE

        self._closed = False
        self._head_sge = _SGE(0, 0, self._staging.lkey)
        self._body_sge = _SGE(0, 0, self._lkey)
        # Multicast results: one UD queue pair and one prebuilt chain of work requests, each
        # over its own scatter entry (a chunk is a slice of the result in the arena), as long
        # as the largest result has chunks. A result of m chunks is the chain's last m, posted
        # with one call; the chain's last is signalled. An address handle per group.
        longest = -(-(HEADER_SIZE + arena.max_payload) // device.mtu)
        self._ud_depth = max(UD_DEPTH, 2 * longest)
        self._ud = device.ud_queue_pair(self._cq, self._ud_depth)
        self._ud_qpn = int(self._ud.qp_num)
        self._ud_chain = [RingWR(arena.address, 0, self._lkey) for _ in range(longest)]
        for ring, after in itertools.pairwise(self._ud_chain):
            ring.wr.next_wr = after.wr  # a raw pointer: the list keeps both alive
        for ring in self._ud_chain:
            ring.wr.opcode = self._e.IBV_WR_SEND_WITH_IMM
        self._ud_chain[-1].wr.send_flags = self._e.IBV_SEND_SIGNALED
        self._ud_outstanding = 0
        self._ud_group = ""  # the group the chain is addressed to
        self._groups: dict[str, Any] = {}  # group IP -> address handle

    # ---- connections (the control plane, through the core's mailbox) ----
    def accept(self, remote: QpEndpoint, address: Address) -> QpEndpoint:
        """Connect a queue pair to a worker's end; its messages arrive from `address`."""
        if address in self._by_address:
            self.disconnect(address)
        if not self._free_index:
            raise ReductionError(f"this core serves {self._max_peers} queue pairs already")
        index = self._free_index.pop()
        qp = self.device.rc_queue_pair(self._cq, self._srq, self._send_depth)
        try:
            local = self.device.endpoint(qp, multicast_qpn=self._ud_qpn)
            self.device.connect(qp, local, remote)
        except BaseException:
            qp.close()
            self._free_index.append(index)
            raise
        first = index * self._send_depth
        ring = [RingWR(self._staging.address(first + i), 0, self._staging.lkey)
                for i in range(self._send_depth)]
        peer = _Peer(index, address, qp, local, remote, ring, first)
        self._peers[int(qp.qp_num)] = peer
        self._by_address[address] = peer
        return local

    def serves(self, address: Address) -> bool:
        return address in self._by_address or address[1] == ROCE_GROUP_PORT

    def disconnect(self, address: Address) -> None:
        peer = self._by_address.pop(address, None)
        if peer is None:
            return
        self._peers.pop(int(peer.qp.qp_num), None)
        peer.qp.close()
        for wr in peer.ring:
            wr.close()
        self._free_index.append(peer.index)

    def queue_pairs(self) -> list[dict[str, object]]:
        """What status shows per connection (as `rdma res show qp` would, plus our counts)."""
        return [{"address": list(p.address), "local": p.local.as_json(),
                 "remote": p.remote.as_json(), "state": "ERR" if p.lost else "RTS",
                 "lost": p.lost, "outstanding": p.outstanding}
                for p in self._by_address.values()]

    def _lose(self, peer: _Peer, why: str) -> None:
        if not peer.lost:
            peer.lost = why
            self._cells[Counter.ROCE_PEERS_LOST] += 1
            self.device.fail(peer.qp)

    # ---- the seam ----
    def fileno(self) -> int:
        return -1

    def _restock(self, pool: Any) -> None:
        srq, wrs = self._srq, self._recv_wrs
        posted = 0
        while self._posted < self._recv_depth:
            index = pool.take()
            if index is None:
                break
            srq.post_recv(wrs[index])
            self._posted += 1
            posted += 1
        if posted:
            self._cells[Counter.ROCE_POST_RECV] += posted

    def receive(self, pool: Any, batch: RxBatch, limit: int) -> int:
        batch.clear()
        self._restock(pool)
        npolled, wcs = self._cq.poll(limit)
        cells = self._cells
        cells[Counter.ROCE_POLLS] += 1
        if not npolled:
            return 0
        cells[Counter.ROCE_COMPLETIONS] += npolled
        success = self._e.IBV_WC_SUCCESS
        with_imm = self._e.IBV_WC_WITH_IMM
        for wc in wcs:
            wr_id = wc.wr_id
            if wr_id < _SEND_TAG:  # a receive: wr_id is the pool buffer
                self._posted -= 1
                peer = self._peers.get(wc.qp_num)
                if wc.status != success or peer is None or peer.lost:
                    pool.release(wr_id)
                    if peer is not None and wc.status != success:
                        self._lose(peer, self._status(wc))
                    continue
                if wc.wc_flags & with_imm and wc.imm_data != int.from_bytes(
                        pool.views[wr_id][_SLOT_AT], "big"):
                    pool.release(wr_id)  # torn or misaddressed: the peer's fault
                    cells[Counter.ROCE_DROP_IMMEDIATE] += 1
                    continue
                batch.add(wr_id, wc.byte_len, peer.address)
                continue
            if wc.qp_num == self._ud_qpn:
                self._ud_outstanding -= wr_id & 0xFFFFF
                continue  # a UD send cannot fail for a peer's sake
            sender = self._peers.get(wc.qp_num)
            if sender is None:
                continue  # a queue pair since disconnected
            sender.outstanding -= wr_id & 0xFFFFF
            if wc.status != success:
                self._lose(sender, self._status(wc))
        self._restock(pool)
        return batch.count

    def _status(self, wc: Any) -> str:
        from pyverbs.cq import WC

        try:
            text = WC.status_to_str(wc.status)  # rdma-core >= 46
        except AttributeError:
            text = f"status {wc.status}"
        return f"completion error ({text}, vendor error {wc.vendor_err})"

    def send(self, sends: Sequence[Send]) -> None:
        counts = self._transport_counts
        cells = self._cells
        for s in sends:
            peer = self._by_address.get(s.dest)
            if peer is None or peer.lost:
                if s.dest[1] == ROCE_GROUP_PORT:
                    self._multicast(s)
                else:
                    counts.send_errors += 1
                continue
            if peer.outstanding >= self._send_depth:
                counts.send_errors += 1
                cells[Counter.ROCE_SEND_QUEUE_FULL] += 1
                continue
            header, payload = s.header, s.payload
            nhead, nbody = len(header), len(payload)
            landing = peer.remote.landing
            slot = -1  # where a large message lands (-1: sent, not written)
            if nhead + nbody > SEND_BYTES:
                slot = self._landing_slot(landing, header, nhead + nbody)
                if slot < 0:  # a worker takes nothing else this large
                    counts.send_errors += 1
                    cells[Counter.ROCE_UNSENDABLE] += 1
                    continue
            entry = peer.seq % self._send_depth
            peer.seq += 1
            peer.outstanding += 1
            peer.unsignalled += 1
            signalled = peer.unsignalled >= SIGNAL_EVERY
            wr_id = _SEND_TAG | peer.unsignalled
            if signalled:
                peer.unsignalled = 0
            flags = self._e.IBV_SEND_SIGNALED if signalled else 0
            ring = peer.ring[entry]
            wr, sge = ring.wr, ring.sge
            try:
                if nhead + nbody <= SEND_BYTES:  # a notice, a small result: one copy
                    view = self._staging.views[peer.staging + entry]
                    view[:nhead] = header
                    view[nhead:nhead + nbody] = payload
                    sge.addr = self._staging.address(peer.staging + entry)
                    sge.lkey = self._staging.lkey
                    sge.length = nhead + nbody
                elif (start := self._contiguous(header, payload)) is not None:
                    # A result: its header sits right before it in the arena (SlotArena), so
                    # the message is one scatter entry of registered memory, sent in place.
                    sge.addr = start
                    sge.lkey = self._lkey
                    sge.length = nhead + nbody
                else:
                    self._post_gathered(peer, entry, header, payload, wr_id, flags, slot)
                    wr = None
                if wr is not None:
                    wr.wr_id = wr_id
                    wr.send_flags = flags
                    self._aim(wr, landing, slot)
                    peer.qp.post_send(wr)
            except Exception as exc:  # the QP is in error: its peer is gone
                self._lose(peer, f"post_send failed: {exc}")
                counts.send_errors += 1
                continue
            cells[Counter.ROCE_POST_SEND] += 1
            if slot >= 0:
                cells[Counter.ROCE_RESULT_WRITES] += 1
            counts.datagrams_sent += 1
            counts.bytes_sent += nhead + nbody

    def _multicast(self, s: Send) -> None:
        """A result to a job's group: chunks of the path MTU straight from the arena, each a
        UD SEND_WITH_IMM to the group, posted as one chain. A result that does not fit the send
        queue whole is dropped (counted): the workers' queries repair it over their queue
        pairs."""
        counts, cells = self._transport_counts, self._cells
        header, nbytes = s.header, len(s.header) + len(s.payload)
        start = self._contiguous(header, s.payload)
        mtu = self.device.mtu
        chunks = -(-nbytes // mtu)
        if start is None or header[_KIND_AT] != Kind.RESULT or chunks > len(self._ud_chain):
            counts.send_errors += 1
            cells[Counter.ROCE_UNSENDABLE] += 1
            return
        if self._ud_outstanding + chunks > self._ud_depth:
            counts.send_errors += 1
            cells[Counter.ROCE_SEND_QUEUE_FULL] += 1
            return
        chain = self._ud_chain[-chunks:]
        if s.dest[0] != self._ud_group:
            ah = self._groups.get(s.dest[0])
            if ah is None:
                ah = self._groups[s.dest[0]] = self.device.multicast_ah(s.dest[0])
            for ring in self._ud_chain:
                ring.wr.set_wr_ud(ah, MULTICAST_QPN, MULTICAST_QKEY)
            self._ud_group = s.dest[0]
        slot = int.from_bytes(header[_SLOT_AT], "big")
        tag = ChunkTag.pack(slot, int.from_bytes(header[_USE_AT], "big"), 0)
        for c, ring in enumerate(chain):
            sge = ring.sge
            sge.addr = start + c * mtu
            sge.length = min(mtu, nbytes - c * mtu)
            ring.wr.imm_data = tag | c
        chain[-1].wr.wr_id = _SEND_TAG | chunks
        try:
            self._ud.post_send(chain[0].wr)
        except Exception:  # the device refused (ours, not a peer's): like a loss, which the
            counts.send_errors += 1  # workers' queries repair; nothing signalled went
            return
        self._ud_outstanding += chunks
        cells[Counter.ROCE_POST_SEND] += 1
        cells[Counter.ROCE_MULTICAST_CHUNKS] += chunks
        counts.datagrams_sent += 1
        counts.bytes_sent += nbytes

    @staticmethod
    def _landing_slot(landing: Landing | None, header: bytes | bytearray | memoryview,
                      nbytes: int) -> int:
        """The landing entry a large message is written to: its slot, when it is a result
        that fits one (-1: it cannot go)."""
        if landing is None or header[_KIND_AT] != Kind.RESULT:
            return -1
        slot = int.from_bytes(header[_SLOT_AT], "big")
        return slot if slot < landing.slots and nbytes <= landing.stride else -1

    def _aim(self, wr: Any, landing: Landing | None, slot: int) -> None:
        """A SEND, or (slot >= 0) a WRITE_WITH_IMM into the slot's landing entry."""
        if slot < 0:
            wr.opcode = self._e.IBV_WR_SEND
            return
        assert landing is not None
        wr.opcode = self._e.IBV_WR_RDMA_WRITE_WITH_IMM
        wr.imm_data = slot
        wr.set_wr_rdma(landing.rkey, landing.address + slot * landing.stride)

    def _contiguous(self, header: bytes | bytearray | memoryview,
                    payload: memoryview | bytes) -> int | None:
        """Where header-then-payload starts when both lie back to back in the arena."""
        if not isinstance(header, memoryview):
            return None
        head = int(np.frombuffer(header, dtype=np.uint8).ctypes.data)
        if not self.arena.address <= head < self._arena_end:
            return None
        body = int(np.frombuffer(payload, dtype=np.uint8).ctypes.data)
        return head if body == head + len(header) else None

    def _post_gathered(self, peer: _Peer, entry: int, header: bytes | bytearray | memoryview,
                       payload: memoryview | bytes, wr_id: int, flags: int, slot: int) -> None:
        """A large result whose header is not in front of it (not one the aggregator makes:
        see `SlotArena.header_before`): header staged, payload from the arena. Two scatter
        entries need a WR of their own (pyverbs cannot repoint one at two); it is released
        right after the post, which copies it into the send queue."""
        from pyverbs.wr import SendWR

        self._staging.views[peer.staging + entry][:len(header)] = header
        body = np.frombuffer(payload, dtype=np.uint8)
        address = int(body.ctypes.data)
        if not self.arena.address <= address < self._arena_end:
            raise RuntimeError("a large message outside the registered arena")  # our bug
        head, tail = self._head_sge, self._body_sge
        head.addr = self._staging.address(peer.staging + entry)
        head.length = len(header)
        tail.addr = address
        tail.length = body.nbytes
        wr = SendWR(wr_id=wr_id, opcode=self._e.IBV_WR_SEND, num_sge=2, sg=[head, tail],
                    send_flags=flags)
        try:
            self._aim(wr, peer.remote.landing, slot)
            peer.qp.post_send(wr)
        finally:
            wr.close()

    def take_counts(self) -> TransportCounts:
        counts, self._transport_counts = self._transport_counts, TransportCounts()
        return counts

    def fallbacks(self) -> tuple[str, ...]:
        return ()

    def closed_ports(self) -> list[Address] | None:
        """None: a peer whose process ends errs its queue pair, and falls silent."""
        return None

    def close_peers(self) -> None:
        """Destroy every queue pair (the core stops serving RoCE; peers see errors)."""
        for address in list(self._by_address):
            self.disconnect(address)

    def close(self) -> None:
        """Idempotent: pyverbs 44 frees a work request's memory again on a second close."""
        if self._closed:
            return
        self._closed = True
        self.close_peers()
        self._ud.close()
        for ah in self._groups.values():
            ah.close()
        for ring in self._ud_chain:
            ring.close()
        self._head_sge.close()
        self._body_sge.close()
        for wr in self._recv_wrs:
            wr.close()
        self._srq.close()
        self._cq.close()
        self._staging.close()
        self._mr.close()
