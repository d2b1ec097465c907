"""The headers of a round's first transmissions, packed once for the whole round.

A fast link's worker sends every segment of a round once, and nearly all of a header is known
when the round starts: the core, job and cookie, the rank, round and epoch, the segment's slot,
offset and length. Only three fields are decided as the segment leaves: the slot's use number
(`SlotUses`, shared with the rounds before), the send sequence to its core (`SendOrder`) and our
QUEUED flag (plugin/congestion.py). So the round packs every header at its start, in one numpy
pass over a structured view (`HEADER_RECORD`, the layout of wire.HEADER; a round of a few
segments with wire.HEADER itself, each), and a first
transmission writes those three fields into its own 48 bytes and leaves with a view of them:
a NamedTuple built, packed and thrown away per segment was a fifth of a worker's Python per
segment (bench.hotpath).

Sans-I/O: bytes in, bytes out.
"""

from __future__ import annotations

import struct

import numpy as np

from reduction_appliance.dataplane.wire import (
    FLAGS_AT,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    SERIAL_AT,
    VERSION,
    DType,
    Kind,
    Op,
)

from .slotplan import Endpoint

__all__ = ["FLAGS_AT", "HEADER_RECORD", "USE", "USE_AT", "first_headers"]

#: wire.HEADER as numpy sees it: the same 48 bytes, in network byte order, field by field
HEADER_RECORD = np.dtype([
    ("magic", ">u2"), ("version", "u1"), ("kind", "u1"), ("dtype", "u1"), ("op", "u1"),
    ("flags", "u1"), ("serial", "u1"), ("job_id", ">u4"), ("rank", ">u2"), ("epoch", ">u2"),
    ("cookie", ">u8"), ("round", ">u4"), ("slot", ">u4"), ("offset", ">u8"),
    ("length", ">u4"), ("use", ">u4"),
])
assert HEADER_RECORD.itemsize == HEADER_SIZE
assert HEADER_RECORD.fields is not None and HEADER_RECORD.fields["serial"][1] == SERIAL_AT
assert HEADER_RECORD.fields["flags"][1] == FLAGS_AT
USE_AT = HEADER_RECORD.fields["use"][1]
USE = struct.Struct("!I")  # the use field, written as the segment leaves
# Rounds of fewer segments pack each header alone: numpy's pass costs about 15 us whatever the
# count, one header about 1 us (a one-float allreduce, a metric's each step, spent 18 us here).
_PACK_EACH_BELOW = 9
_pack = HEADER.pack_into
_CONTRIBUTION = int(Kind.CONTRIBUTION)


def first_headers(endpoints: tuple[Endpoint, ...], rank: int, round_no: int, epoch: int,
                  dtype: DType, op: Op, nbytes: int, segment_bytes: int) -> bytearray:
    """Segment k's CONTRIBUTION header at [k * HEADER_SIZE, (k + 1) * HEADER_SIZE), for every
    segment of the round (plugin/session.py's geometry: segment k goes to endpoint k mod E,
    where it is the (k div E)-th and takes slot (k div E) mod S of its lane), with no flags,
    send sequence 0 and use 0 (filled in as it leaves)."""
    segments = -(-nbytes // segment_bytes)
    block = bytearray(segments * HEADER_SIZE)
    if segments < _PACK_EACH_BELOW:
        cores = len(endpoints)
        for i in range(segments):
            ep = endpoints[i % cores]
            start = i * segment_bytes
            _pack(block, i * HEADER_SIZE, MAGIC, VERSION, _CONTRIBUTION, dtype, op, 0,
                  ep.job_id, rank, epoch, ep.cookie, round_no,
                  ep.slot_base + (i // cores) % ep.slots, start,
                  min(segment_bytes, nbytes - start), 0)
        return block
    records = np.frombuffer(block, HEADER_RECORD)
    k = np.arange(segments, dtype=np.int64)
    m, core = np.divmod(k, len(endpoints))
    field = np.array([[ep.job_id, ep.cookie, ep.slot_base, ep.slots] for ep in endpoints],
                     dtype=np.uint64)[core]
    records["magic"] = MAGIC
    records["version"] = VERSION
    records["kind"] = int(Kind.CONTRIBUTION)
    records["dtype"] = int(dtype)
    records["op"] = int(op)
    records["job_id"] = field[:, 0]
    records["rank"] = rank
    records["epoch"] = epoch
    records["cookie"] = field[:, 1]
    records["round"] = round_no
    records["slot"] = field[:, 2] + m.astype(np.uint64) % field[:, 3]
    offset = k * segment_bytes
    records["offset"] = offset
    records["length"] = np.minimum(segment_bytes, nbytes - offset)
    return block
