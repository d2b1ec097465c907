"""The one wire format shared by workers and the appliance.

Every datagram is a fixed 48-byte header followed by the payload (a segment of a tensor in the
dtype named by the header, a rank bitmap for PENDING, a reason for DIVERGED, silent-rank records
for LIVENESS, send sequences for MISSING, its sender's newest send sequence for a QUERY
flagged SENT, padding for a path probe and its echo; nothing for the other notices). All
fields are in network byte order::

     0                   1                   2                   3
     0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    +-------------------------------+---------------+---------------+
    |         magic 0x5241 "RA"     |    version    |     kind      |   0
    +---------------+---------------+---------------+---------------+
    |     dtype     |      op       |     flags     |    serial     |   4
    +---------------+---------------+---------------+---------------+
    |                            job id                             |   8
    +-------------------------------+-------------------------------+
    |             rank              |     epoch (of the job)        |  12
    +-------------------------------+-------------------------------+
    |                                                               |  16
    +                      cookie (64 bits)                         +
    |                                                               |  20
    +---------------------------------------------------------------+
    |                  round (allreduce generation)                 |  24
    +---------------------------------------------------------------+
    |                  slot (job-relative, per core)                |  28
    +---------------------------------------------------------------+
    |                                                               |  32
    +              segment offset in the tensor (bytes)             +
    |                                                               |  36
    +---------------------------------------------------------------+
    |                    payload length (bytes)                     |  40
    +---------------------------------------------------------------+
    |       use: the slot's use number within the epoch (1, 2..)    |  44
    +---------------------------------------------------------------+

A LIVENESS payload is a list of silent ranks, one 12-byte record each (`SILENT`)::

    L | C | rank (14) | port (16) | IPv4 address (32) | silent for, milliseconds (32)

L (`SILENT_LEFT`) says the rank left the job (its worker said so) rather than went quiet: its
peers still waiting for it made more all_reduce calls than it did. C (`SILENT_CLOSED`) says its
host answered a REACH with ICMP port unreachable: nothing listens at its endpoint any more, so
its process ended without leaving (killed, crashed, or exited).

Its `round` echoes the HEARTBEAT's, so a worker can tell a fresh answer from one that waited in
its socket. It names at most `SILENT_RECORDS` ranks, the most telling first (ended, then
silent, longest first, then left); its `slot` counts the silent ranks in all (0 in a LIVENESS
flagged UNASKED, which names one: `silent_in_all`).

A RESULT's `serial` numbers the results one appliance core sends for a job (mod 256), in the
order it sends them; a QUERY flagged SERIAL carries the newest serial its sender has from that
core. Results to a worker travel one path in order, so a result with an older serial than that
was lost, and one with a newer serial is still on its way (the appliance resends only the
first). On a first transmission of a CONTRIBUTION, `serial` is its sender's send sequence to
that core (mod 256, every round of the job counted alike): contributions of one rank travel
one path in order, so a core that sees the sequence jump knows the contributions in between
were lost, and says so at once (MISSING). A gap at the end (the last contributions before a
pause) shows no jump; a QUERY names its sender's newest send sequence (SENT) and shows it.
Zero when unused.

A RESULT's `rank` is the rank whose contribution completed it (the last to arrive): that
rank alone may take the result's round trip as a sample of the path's queues, since it waited
for no peer, and its contribution's QUEUED flag, echoed in the RESULT, tells the other ranks
what it found (plugin/congestion.py). When that contribution was a retransmission, or a first
transmission flagged REPAIRED (its sender began the round late: its previous round's last
result came resent to it alone, flagged RETRANSMIT), the RESULT carries REPAIRED: its round
trip holds a repair, and no rank takes it as a sample of the path (Karn's rule, kept for the
peers too).

A segment is named by (job, round, offset); the slot says where the appliance aggregates it and
`use` which use of that slot it is. Every rank numbers the uses of each slot alike (1, 2, ... in
the order the slot is used), so the appliance accepts exactly the slot's current use, the one
before (a late retransmission) and the next: anything else is out of the window and cannot
occupy a slot. The epoch numbers the job's resynchronisations (a rank re-joined); rounds and
uses count from the start of an epoch, and past WRAP (the field's 32 bits) start at 1 again:
"before" and "next" are then taken around the wrap (`number_before`, `next_number`). Packing
and unpacking work on caller-owned buffers with one precompiled struct, so the hot path never
builds intermediate bytes objects.
"""

from __future__ import annotations

import socket
import struct
from enum import IntEnum, IntFlag
from typing import NamedTuple

from .errors import PeerError

__all__ = [
    "FLAGS_AT",
    "HEADER",
    "HEADER_SIZE",
    "IP_UDP_HEADERS",
    "ITEMSIZE",
    "MAGIC",
    "SERIALS",
    "SERIAL_AT",
    "SILENT",
    "SILENT_CLOSED",
    "SILENT_LEFT",
    "SILENT_RECORDS",
    "VERSION",
    "WRAP",
    "DType",
    "Flags",
    "Header",
    "Kind",
    "Op",
    "SilentRank",
    "WireError",
    "beat_interval",
    "next_number",
    "number_before",
    "pack_into",
    "pack_silent",
    "peek_kind",
    "peek_round",
    "peek_slot",
    "serial_newer",
    "silent_in_all",
    "unpack",
    "unpack_silent",
]

MAGIC = 0x5241
VERSION = 9  # 4: contributions numbered per core (serial), MISSING; 5: QUERY's SENT; 6: L;
# 7: PATH_PROBE and PATH_ECHO; 8: UNKNOWN_JOB; 9: REACH and C

# Byte 7 (`serial`) is read and written apart from HEADER, whose pad byte it is: a datagram
# packed with HEADER alone carries serial 0.
HEADER = struct.Struct("!HBBBBBxIHHQIIQII")
SERIAL_AT = 7
FLAGS_AT = 6  # the flags byte (a RESULT resent to one rank is its stored header, re-flagged)
SERIALS = 256  # serials wrap; see `serial_newer`
# Rounds and a slot's uses are numbered 1, 2, ... WRAP, then 1 again (0: none yet): the header
# holds 32 bits of each, and a long job passes them (a slot used 3,000 times a second passes
# 2**32 uses in 17 days; 100 Gbit/s of 8.9 KB segments over 8 cores of 32 slots, in 9 days).
WRAP = 2**32 - 1
HEADER_SIZE = HEADER.size
IP_UDP_HEADERS = 28  # what a datagram adds to its payload on the wire: IPv4 (20) + UDP (8)
assert HEADER_SIZE == 48
SILENT = struct.Struct("!HH4sI")
SILENT_LEFT = 0x8000  # in a SILENT record's rank field (ranks are below 4096)
SILENT_CLOSED = 0x4000  # ... its endpoint's port is closed (dataplane.reach)
# A LIVENESS names at most this many ranks (its `slot` says how many are silent in all): 1276
# bytes on the wire, whole on any IPv4 path of MTU 1280 or more and in a RoCE SEND
# (verbs.SEND_BYTES). A rack that lost power silences hundreds of ranks at once; every
# record of them made an answer that a RoCE SEND could not carry and a 1500-byte path
# fragmented, and a worker needs only the first to fail with the right error.
SILENT_RECORDS = 100
assert HEADER_SIZE + SILENT_RECORDS * SILENT.size + IP_UDP_HEADERS <= 1280


class Kind(IntEnum):
    """What a datagram is."""

    CONTRIBUTION = 1  # worker -> appliance: one rank's segment
    RESULT = 2  # appliance -> workers: the reduced segment; rank = the one that completed it
    # appliance -> one worker: segment not finished; payload = arrived-rank bitmap. Sent to a
    # worker that retransmitted or queried, and to each rank the segment still waits for (its
    # bit clear: "yours never came", so it resends at once instead of at its timer).
    PENDING = 3
    ABORTED = 4  # appliance -> one worker: the job was aborted; payload: why, UTF-8 (or none)
    RESYNC = 5  # appliance -> one worker: the job is at `epoch`; yours is stale; no payload
    DIVERGED = 6  # appliance -> workers: ranks disagree on a slot's use; payload = the reason
    HEARTBEAT = 7  # worker -> appliance core: this rank is alive; no payload
    LIVENESS = 8  # appliance -> one worker: the answer to HEARTBEAT; payload = silent ranks
    # worker -> appliance core: a retransmission as a contribution's header without its
    # payload (`length` names the segment's): "the result, or tell me what you lack". Answered
    # with the result if finished, else PENDING; 48 bytes instead of a segment, since a lost
    # result or a late peer is likelier than a lost contribution.
    QUERY = 9
    # appliance core -> one worker: contributions of yours that never came, though later ones
    # did; payload = their send sequences (one byte each, see `serial`). Resend them now.
    MISSING = 10
    # worker -> appliance core, when it joins: does the path carry the job's datagrams whole?
    # payload = padding (the size under test on the way up); `offset` = the payload size of
    # the PATH_ECHO wanted (the size under test on the way down); `round` = a number the echo
    # carries back. Answered to a bound rank only, never longer than a segment
    # (plugin/pathprobe.py).
    PATH_PROBE = 11
    # appliance core -> one worker: the answer to PATH_PROBE; payload = zeros of the size it
    # asked for; `offset` = the payload size the probe arrived with; `round` its number.
    PATH_ECHO = 12
    # appliance core -> one worker: the answer to a HEARTBEAT of a job this core does not
    # have, or with another cookie than its job's: the appliance restarted without the job,
    # the job ended, or this core is being restarted and has not got its jobs back yet. The
    # header echoes the heartbeat's, cookie included (only who saw the heartbeat can answer
    # it); no payload. A hint, not a verdict: the worker asks the appliance's API.
    UNKNOWN_JOB = 13
    # appliance core -> one worker a slot waits for, not heard for 1.5 heartbeat intervals: is
    # anything still listening there? No payload; a live worker ignores it, and a host whose
    # port is closed answers ICMP port unreachable (dataplane.reach).
    REACH = 14


class DType(IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self]


ITEMSIZE = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2}


class Op(IntEnum):
    SUM = 1
    AVG = 2
    MIN = 3
    MAX = 4


class Flags(IntFlag):
    NONE = 0
    # The worker has sent this segment before (counted, not trusted). On a RESULT: resent to
    # the one rank that asked again (its first copy was lost): that rank got it after its peers.
    RETRANSMIT = 1
    # On a QUERY: sent by a timer for a segment after which nothing sent to that core has been
    # answered, in a round that repaired no loss (a stall, not a hole): the result may well be
    # on its way already.
    PROBE = 2
    # On a QUERY: `serial` is the newest RESULT serial its sender has from that core.
    SERIAL = 4
    # On a QUERY: its one-byte payload is the send sequence of the newest first transmission
    # its sender made to that core, so that the core sees a gap at the end of what it got.
    SENT = 8
    # On a CONTRIBUTION: its sender's latest round trip to the core, from a result its own
    # contribution completed, was over the job's queue target (a queue stands on the path).
    # On a RESULT: the contribution that completed it said so, and every rank's window on the
    # core shrinks, not only the completer's (plugin/congestion.py): in-band, as ECN's echo.
    QUEUED = 16
    # On a RESULT: the contribution that completed it was a retransmission, or carried this
    # flag. Every rank's round trip for it holds a repair, so none takes it as a sample for
    # its retransmission timer: with many ranks under loss, most results wait for some rank's
    # repair, and samples that held one raised every rank's timer, so the next repairs waited
    # longer, and the samples grew again (16 ranks at 2% loss: the timers reached their 1 s
    # bound within 25 calls). On a first transmission: its sender starts the round late by a
    # repair of its own (its previous round's last result was resent to it alone).
    REPAIRED = 32
    # On a LIVENESS: not an answer to a heartbeat. A core whose segments the rank waits on
    # found the ranks it names ended (dataplane.reach); rounds waiting for them fail.
    UNASKED = 64


class WireError(PeerError):
    """A datagram that is not ours or is malformed: the peer's fault, counted and dropped."""


class Header(NamedTuple):
    kind: Kind
    dtype: DType
    op: Op
    flags: int
    job_id: int
    rank: int
    cookie: int
    round: int
    slot: int
    offset: int
    length: int
    use: int = 0
    epoch: int = 0
    serial: int = 0


# Dict lookups, not Enum(value) calls: decoding runs once per datagram.
_KINDS = {int(k): k for k in Kind}
_DTYPES = {int(d): d for d in DType}
_OPS = {int(o): o for o in Op}
_new_tuple = tuple.__new__


def pack_into(buf: bytearray | memoryview, h: Header, at: int = 0) -> None:
    """Write `h` into `buf[at:at + HEADER_SIZE]`."""
    # One unpacking, not fourteen field lookups: this runs once per datagram sent.
    kind, dtype, op, flags, job_id, rank, cookie, rnd, slot, offset, length, use, epoch, serial = h
    HEADER.pack_into(buf, at, MAGIC, VERSION, kind, dtype, op, flags, job_id, rank, epoch,
                     cookie, rnd, slot, offset, length, use)
    if serial:
        buf[at + SERIAL_AT] = serial


def unpack(buf: bytes | bytearray | memoryview, at: int = 0) -> Header:
    """Decode and validate a header; raise `WireError` for anything we would not have sent."""
    if len(buf) - at < HEADER_SIZE:
        raise WireError(f"datagram of {len(buf) - at} bytes is shorter than the header")
    (magic, version, kind, dtype, op, flags, job_id, rank, epoch, cookie, rnd, slot, offset,
     length, use) = HEADER.unpack_from(buf, at)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic:#06x}")
    if version != VERSION:
        raise WireError(f"unsupported version {version}")
    k, d, o = _KINDS.get(kind), _DTYPES.get(dtype), _OPS.get(op)
    if k is None or d is None or o is None:
        raise WireError(f"unknown kind/dtype/op {kind}/{dtype}/{op}")
    # tuple.__new__ with the fields in order: a NamedTuple's keyword-capable __new__ costs
    # 0.3 us more, once per datagram at both ends.
    return _new_tuple(Header, (k, d, o, flags, job_id, rank, cookie, rnd, slot, offset, length,
                               use, epoch, buf[at + SERIAL_AT]))


_KIND_AT = 3  # HEADER's kind byte (see the diagram)
_ROUND = struct.Struct("!I")
_ROUND_AT = 24  # HEADER's round field


def peek_kind(buf: bytes | bytearray | memoryview, at: int = 0) -> int:
    """The kind byte of the header at `at`, nothing else read or checked."""
    return buf[at + _KIND_AT]


def peek_round(buf: bytes | bytearray | memoryview, at: int = 0) -> int:
    """The round the header at `at` names, nothing else read or checked (a worker's way to
    find which round a coalesced receive belongs to before it decodes anything)."""
    return int(_ROUND.unpack_from(buf, at + _ROUND_AT)[0])


_SLOT = struct.Struct("!I")
_SLOT_AT = 28  # HEADER's slot field


def peek_slot(buf: bytes | bytearray | memoryview, at: int = 0) -> int:
    """The slot the header at `at` names, nothing else read or checked (a transport's way to
    place a packed header's datagram)."""
    return int(_SLOT.unpack_from(buf, at + _SLOT_AT)[0])


def serial_newer(serial: int, than: int) -> bool:
    """Was the result numbered `serial` sent after the one numbered `than`? Serials wrap at
    SERIALS, so this holds for results less than half of SERIALS apart (RFC 1982's rule); a
    core has far fewer in flight to one worker (its slots)."""
    return 0 < (serial - than) % SERIALS < SERIALS // 2


def next_number(number: int) -> int:
    """The round or use numbered after `number` (WRAP is followed by 1; 0, none yet, by 1)."""
    return number % WRAP + 1


def number_before(number: int, than: int) -> bool:
    """Was the round or use `number` numbered before `than`? Numbers wrap at WRAP, so this
    holds for numbers less than half of WRAP apart (RFC 1982's rule, as `serial_newer`)."""
    return 0 < (than - number) % WRAP < WRAP // 2


class SilentRank(NamedTuple):
    rank: int
    address: tuple[str, int] | None  # the endpoint it joined from
    silent_s: float
    left: bool = False  # it left the job (and has not joined again)
    closed: bool = False  # its host said nothing listens at its endpoint (not left)


def beat_interval(liveness_s: float) -> float:
    """How often a worker heartbeats each appliance: ten times per liveness timeout."""
    return max(0.05, liveness_s / 10)


def pack_silent(ranks: list[SilentRank]) -> bytes:
    out = bytearray()
    for r in ranks:
        host, port = r.address or ("0.0.0.0", 0)
        flags = (SILENT_LEFT if r.left else 0) | (SILENT_CLOSED if r.closed else 0)
        out += SILENT.pack(r.rank | flags, port, socket.inet_aton(host),
                           min(int(r.silent_s * 1000), 2**32 - 1))
    return bytes(out)


def silent_in_all(h: Header, named: list[SilentRank]) -> int:
    """How many ranks a LIVENESS with header `h` says are silent, `named` being its records."""
    return max(h.slot, len(named))


def unpack_silent(payload: bytes | memoryview) -> list[SilentRank]:
    """The records of a LIVENESS payload; `WireError` for one that is not whole records."""
    if len(payload) % SILENT.size:
        raise WireError(f"LIVENESS payload of {len(payload)} bytes is not whole records")
    return [SilentRank(rank & ~(SILENT_LEFT | SILENT_CLOSED), (socket.inet_ntoa(ip), port),
                       ms / 1000, bool(rank & SILENT_LEFT), bool(rank & SILENT_CLOSED))
            for rank, port, ip, ms in SILENT.iter_unpack(payload)]
