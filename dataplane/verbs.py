"""The verbs plumbing both RoCE transports share: a device, registered memory, RC queue pairs
and the data the control plane exchanges to connect them. pyverbs is imported here only.

Built for Debian 12's pyverbs (rdma-core 44) and tested on soft-RoCE (rxe, deploy/roce). What
that binding costs, and how this module pays for it (docs/roce.md has the measurements):

* Work requests and scatter entries leak 64 bytes each when garbage-collected (their destructor
  is misspelled), and building one costs microseconds: every WR a transport posts is built once
  and reused. `SendWR.sg_list` can be pointed at a persistent `SGE`, whose address and length
  then change per send without a new object (`RingWR`).
* There is no completion-channel descriptor to select on (rdma-core 57 added it): receivers
  poll, backing off between empty polls (see `Backoff`).
* rxe treats an RC `retry_cnt` of 7 as "retry forever": a send to a dead peer would never
  complete. We use 6, and any error completion means the peer is lost.

What travels how: a worker's contribution is one SEND_WITH_IMM (the immediate is its slot) into
a receive buffer of the core's slot arena; a result is one RDMA WRITE_WITH_IMM from the arena
into the worker's landing buffer for that slot (`Landing`; the immediate names the slot); every
other message (notices, PENDING, LIVENESS, small results) is a SEND of at most `SEND_BYTES`.
"""

from __future__ import annotations

import contextlib
import mmap
import random
import select
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConfigError

__all__ = [
    "MULTICAST_QKEY",
    "SEND_BYTES",
    "Backoff",
    "ChunkTag",
    "Landing",
    "QpEndpoint",
    "RegisteredRing",
    "RingWR",
    "RoceDevice",
    "device_for",
    "enums",
    "roce_unavailable",
]

RETRY_COUNT = 6  # 7 is "forever" on rxe: a dead peer must surface as an error completion
ACK_TIMEOUT = 14  # 4.096 us * 2**14 = 67 ms per retry: 6 retries ~ 0.4 s to declare a peer lost
#: the Q_Key of UD multicast (rdma_cm's RDMA_UDP_QKEY: what a worker's join gives it)
MULTICAST_QKEY = 0x01234567
MULTICAST_QPN = 0xFFFFFF  # the destination QP number of a multicast send
GRH_BYTES = 40  # a UD receive buffer starts with the packet's global route header
#: the largest message that travels as a SEND (copied into a staging entry, received into a
#: worker's receive buffer of this size); a larger one is a result, written into its landing
SEND_BYTES = 4096
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu -> bytes


def enums() -> Any:
    """pyverbs' enum module (imported on first use: only RoCE code needs pyverbs)."""
    import pyverbs.enums as enums

    return enums


def roce_unavailable(device: str | None = None) -> str | None:
    """Why RoCE cannot run on this machine (None: it can), in words for a log line."""
    try:
        from pyverbs.device import get_device_list
    except ImportError as exc:
        return (f"pyverbs is not importable ({exc}): install python3-pyverbs and link it into "
                "the venv (bash deploy/roce/guest.sh link-pyverbs .venv)")
    try:
        names = [d.name.decode() for d in get_device_list()]
    except Exception as exc:  # no RDMA subsystem in this kernel: not even an empty list
        return f"no RDMA devices on this machine ({exc})"
    if not names:
        return "no RDMA device on this machine (`rdma link` lists none)"
    if device is not None and device not in names:
        return f"no RDMA device {device!r} here (devices: {', '.join(names)})"
    return None


def device_for(ip: str, port: int = 1, gids: int = 16) -> tuple[str, int] | None:
    """The RDMA device and GID index whose RoCE v2 GID is IPv4 address `ip` (::ffff:ip), or
    None: how a worker finds the device behind its data address."""
    import ipaddress

    from pyverbs.device import Context, get_device_list

    want = ipaddress.IPv4Address(ip)
    for dev in get_device_list():
        name = dev.name.decode()
        with contextlib.closing(Context(name=name)) as ctx:
            for index in range(gids):
                try:
                    gid = ipaddress.IPv6Address(str(ctx.query_gid(port, index)))
                except Exception:  # past the table's end, or an empty entry
                    continue
                if gid.ipv4_mapped == want:
                    return name, index
    return None


class ChunkTag:
    """The immediate of a UD multicast chunk: which result, and which part of it.

    A result message (header, then payload, contiguous in the arena) is cut into chunks of the
    path MTU; chunk c carries its bytes [c * mtu, (c + 1) * mtu), so chunk 0 starts with the
    header and tells the total. The immediate names the slot (12 bits), the low 4 bits of the
    slot's use (a late chunk of the use before is told from the next one's) and the chunk."""

    SLOTS = 1 << 12
    CHUNKS = 1 << 16

    @staticmethod
    def pack(slot: int, use: int, chunk: int) -> int:
        return (slot & 0xFFF) << 20 | (use & 0xF) << 16 | chunk

    @staticmethod
    def unpack(imm: int) -> tuple[int, int, int]:
        return imm >> 20, (imm >> 16) & 0xF, imm & 0xFFFF


def multicast_gid(group: str) -> str:
    """The RoCE v2 GID of IPv4 multicast group `group` (::ffff:a.b.c.d, written out)."""
    import ipaddress

    packed = ipaddress.IPv4Address(group).packed
    return "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}".format(*packed)


@dataclass(frozen=True)
class Landing:
    """Where a worker takes a core's results: `slots` entries of `stride` bytes from `address`
    in a region the core may write (`rkey`), one per slot of the job on that core. The result
    for slot s is written at `address + s * stride` (header, then payload).

    Why one entry per slot is safe to overwrite: a worker sends the next use of a slot only
    after it has taken the result of the last one, and everything a core writes to one worker
    goes through one queue pair, in order; so a later write to an entry is either that same
    result again (a duplicate answer: the same bytes) or the next use's result, which cannot be
    sent before the worker asked for it."""

    address: int
    rkey: int
    slots: int
    stride: int

    def as_json(self) -> dict[str, int]:
        return {"address": self.address, "rkey": self.rkey, "slots": self.slots,
                "stride": self.stride}


@dataclass(frozen=True)
class QpEndpoint:
    """One end of an RC connection as the control plane hands it to the other end: plain data
    (what `rdma res show qp` would show of it), never a verbs object. A worker's end names its
    landing buffers (a core's end: None)."""

    device: str
    gid: str
    qpn: int
    psn: int
    mtu: int  # the port's active MTU in bytes; a connection uses the smaller of two ends'
    landing: Landing | None = None
    multicast_qpn: int = 0  # a core's UD queue pair (multicast results come from it); 0: none

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {"device": self.device, "gid": self.gid, "qpn": self.qpn,
                                  "psn": self.psn, "mtu": self.mtu}
        if self.landing is not None:
            out["landing"] = self.landing.as_json()
        if self.multicast_qpn:
            out["multicast_qpn"] = self.multicast_qpn
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QpEndpoint:
        try:
            landing = d.get("landing")
            if landing is not None:
                landing = Landing(int(landing["address"]), int(landing["rkey"]),
                                  int(landing["slots"]), int(landing["stride"]))
                if landing.slots < 1 or landing.stride < 64 or landing.address <= 0:
                    raise ValueError("landing needs slots >= 1, stride >= 64 and an address")
            return cls(str(d["device"]), str(d["gid"]), int(d["qpn"]), int(d["psn"]),
                       int(d["mtu"]), landing, int(d.get("multicast_qpn", 0)))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a queue-pair endpoint: {d!r} ({exc})") from exc


def _qp_access(e: Any) -> int:
    """Remote writes are allowed on every queue pair: a memory region still has to grant them,
    and only a worker's landing buffers do (`RoceDevice.register(remote_write=True)`)."""
    return int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)


class RoceDevice:
    """An opened RDMA device, its protection domain and one port's addressing."""

    def __init__(self, name: str | None = None, *, port: int = 1, gid_index: int = 1) -> None:
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD

        e = enums()
        if name is None:
            devices = get_device_list()
            if not devices:
                raise ConfigError("no RDMA device on this machine")
            name = devices[0].name.decode()
        self.name = name
        self.port = port
        self.gid_index = gid_index
        self.context = Context(name=name)
        try:
            attr = self.context.query_port(port)
            if attr.state != e.IBV_PORT_ACTIVE:
                raise ConfigError(f"RDMA device {name} port {port} is not ACTIVE")
            self.mtu = _MTU_BYTES.get(int(attr.active_mtu), 1024)
            self.gid = str(self.context.query_gid(port, gid_index))
            self.pd = PD(self.context)
        except BaseException:
            self.context.close()
            raise

    def register(self, address: int, length: int, *, remote_write: bool = False) -> Any:
        """A memory region over memory we own (it must outlive the region); `remote_write`:
        the peer may RDMA-write into it (a worker's landing buffers, nothing else)."""
        from pyverbs.mr import MR

        e = enums()
        access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if remote_write else 0)
        return MR(self.pd, length, access, address=address)

    def completion_queue(self, depth: int) -> Any:
        from pyverbs.cq import CQ

        return CQ(self.context, depth, None, None, 0)

    def shared_receive_queue(self, depth: int) -> Any:
        from pyverbs.srq import SRQ, SrqAttr, SrqInitAttr

        return SRQ(self.pd, SrqInitAttr(SrqAttr(max_wr=depth, max_sge=1)))

    def rc_queue_pair(self, cq: Any, srq: Any, send_depth: int) -> Any:
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = enums()
        cap = QPCap(max_send_wr=send_depth, max_recv_wr=0, max_send_sge=2, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, srq=srq, cap=cap, sq_sig_all=0)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = _qp_access(e)
        return QP(self.pd, init, attr)

    def endpoint(self, qp: Any, landing: Landing | None = None,
                 multicast_qpn: int = 0) -> QpEndpoint:
        return QpEndpoint(self.name, self.gid, int(qp.qp_num), random.getrandbits(24), self.mtu,
                          landing, multicast_qpn)

    def ud_queue_pair(self, cq: Any, send_depth: int) -> Any:
        """A UD queue pair that sends multicast chunks (pyverbs takes it to RTS itself)."""
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = enums()
        cap = QPCap(max_send_wr=send_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        attr = QPAttr(port_num=self.port)
        attr.qkey = MULTICAST_QKEY
        return QP(self.pd, init, attr)

    def multicast_ah(self, group: str) -> Any:
        """An address handle for IPv4 multicast group `group` (a sender needs no join)."""
        from pyverbs.addr import AH, GID, AHAttr, GlobalRoute

        route = GlobalRoute(dgid=GID(multicast_gid(group)), sgid_index=self.gid_index,
                            hop_limit=1)
        return AH(self.pd, attr=AHAttr(port_num=self.port, is_global=1, gr=route))

    def connect(self, qp: Any, local: QpEndpoint, remote: QpEndpoint) -> None:
        """INIT -> RTR -> RTS towards `remote`."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = enums()
        mtu = min(local.mtu, remote.mtu)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = _qp_access(e)  # INIT is applied again on the way to RTS
        attr.path_mtu = {v: k for k, v in _MTU_BYTES.items()}.get(mtu, e.IBV_MTU_1024)
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = local.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 1  # 0.01 ms: a receiver out of posted buffers is retried quickly
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_COUNT
        attr.rnr_retry = 7  # receiver not ready: retry for as long as it takes (flow control)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1,
                              gr=GlobalRoute(dgid=GID(remote.gid), sgid_index=self.gid_index))
        qp.to_rts(attr)

    @staticmethod
    def fail(qp: Any) -> None:
        """Move a queue pair to ERR: its outstanding work completes flushed, nothing new goes."""
        from pyverbs.qp import QPAttr

        e = enums()
        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_ERR
        with contextlib.suppress(Exception):  # already gone with its peer: nothing to stop
            qp.modify(attr, e.IBV_QP_STATE)

    def close(self) -> None:
        self.pd.close()
        self.context.close()

    def __enter__(self) -> RoceDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegisteredRing:
    """`entries` buffers of `entry_bytes` in one page-aligned mapping of our own, registered
    once: send staging (headers, copied small messages) and landing buffers."""

    def __init__(self, device: RoceDevice, entries: int, entry_bytes: int, *,
                 remote_write: bool = False) -> None:
        self.entries = entries
        self.entry_bytes = (entry_bytes + 63) // 64 * 64
        nbytes = (entries * self.entry_bytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.base = int(whole.ctypes.data)
        self.views = [memoryview(self._map)[i * self.entry_bytes:(i + 1) * self.entry_bytes]
                      for i in range(entries)]
        self.mr = device.register(self.base, nbytes, remote_write=remote_write)
        self.lkey = int(self.mr.lkey)
        self.rkey = int(self.mr.rkey)

    def address(self, entry: int) -> int:
        return self.base + entry * self.entry_bytes

    def close(self) -> None:
        self.mr.close()
        for v in self.views:
            v.release()
        self.views.clear()
        with contextlib.suppress(BufferError):  # a caller's view lives on: it goes with that
            self._map.close()


class RingWR:
    """A reusable send work request over one persistent scatter entry: address, length, id and
    signalling change per post, no verbs object is created (see the module note)."""

    __slots__ = ("sge", "wr")

    def __init__(self, address: int, length: int, lkey: int) -> None:
        from pyverbs.wr import SGE, SendWR

        e = enums()
        self.sge = SGE(address, length, lkey)
        self.wr = SendWR(opcode=e.IBV_WR_SEND, num_sge=1, sg=[self.sge], send_flags=0)
        self.wr.sg_list = self.sge  # the WR now reads this SGE's memory at every post

    def close(self) -> None:
        self.sge.close()


class Backoff:
    """Polling without a completion descriptor: empty polls sleep in `select` on `wake` (or
    nothing) for 20 us doubling to 1 ms, so an idle receiver costs little CPU and a busy one
    notices a completion within about the last sleep."""

    FIRST_S = 20e-6
    LONGEST_S = 1e-3

    def __init__(self) -> None:
        self.sleep_s = self.FIRST_S

    def reset(self) -> None:
        self.sleep_s = self.FIRST_S

    def pause(self, deadline: float | None, wake: Any = None) -> bool:
        """Sleep one step (never past `deadline`); False when the deadline has passed or
        `wake` became readable."""
        now = time.monotonic()
        step = self.sleep_s
        if deadline is not None:
            if now >= deadline:
                return False
            step = min(step, deadline - now)
        self.sleep_s = min(self.LONGEST_S, self.sleep_s * 2)
        readable, _, _ = select.select([wake] if wake is not None else [], [], [], step)
        return not readable
