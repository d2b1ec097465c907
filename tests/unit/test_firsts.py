"""A round's first transmissions' headers, packed at its start (plugin/firsts.py): the numpy
record is wire.HEADER's layout, every packed header is the one `wire.pack_into` writes for that
segment, and what the send path takes (`due_packed`) is what `due` says, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from reduction_appliance.dataplane import wire
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
    peek_slot,
)
from reduction_appliance.plugin.firsts import HEADER_RECORD, first_headers
from reduction_appliance.plugin.rtt import RttEstimator
from reduction_appliance.plugin.session import AllreduceRound
from reduction_appliance.plugin.slotplan import Endpoint, transmit_of
from tests.unit.test_wire import headers


def _packed(h: Header) -> bytes:
    buf = bytearray(HEADER_SIZE)
    pack_into(buf, h)
    return bytes(buf)


@settings(max_examples=300)
@given(headers)
def test_the_record_reads_every_field_as_the_struct_wrote_it(h: Header) -> None:
    (record,) = np.frombuffer(_packed(h), HEADER_RECORD)
    assert (record["magic"], record["version"]) == (wire.MAGIC, wire.VERSION)
    for name in Header._fields:
        assert int(record[name]) == int(getattr(h, name)), name
    assert peek_slot(_packed(h)) == h.slot


def _endpoints(count: int, slots: int, slot_base: int = 0) -> tuple[Endpoint, ...]:
    # Cores of different appliances: each its own job, cookie (top bit set: unsigned 64 bits)
    # and lane of slots.
    return tuple(Endpoint(("198.18.0.1", 7000 + e), 10 + e, 2**63 + 77 * e, slots + e,
                          f"core {e}", slot_base=slot_base + 3 * e, appliance=e)
                 for e in range(count))


@pytest.mark.parametrize("cores, nbytes, segment", [
    (1, 4096, 1024),  # whole segments
    (2, 10_000, 1024),  # a short last one
    (3, 64 * 8896 + 4, 8896),  # more segments than slots: slots reused
    (2, 4, 8896),  # one short segment
    (3, 8 * 1024, 1024),  # the most segments packed one by one
    (3, 8 * 1024 + 1, 1024),  # the fewest packed in one numpy pass
])
def test_every_header_is_the_one_pack_into_writes(cores: int, nbytes: int,
                                                  segment: int) -> None:
    endpoints = _endpoints(cores, slots=8, slot_base=5)
    block = first_headers(endpoints, 3, 9, 2, DType.FLOAT32, Op.MAX, nbytes, segment)
    segments = -(-nbytes // segment)
    assert len(block) == segments * HEADER_SIZE
    for k in range(segments):
        ep = endpoints[k % cores]
        want = Header(Kind.CONTRIBUTION, DType.FLOAT32, Op.MAX, Flags.NONE, ep.job_id, 3,
                      ep.cookie, 9, ep.slot_base + (k // cores) % ep.slots, k * segment,
                      min(segment, nbytes - k * segment), 0, 2, 0)
        assert bytes(block[k * HEADER_SIZE:(k + 1) * HEADER_SIZE]) == _packed(want), k


def test_no_bytes_no_headers() -> None:
    assert first_headers(_endpoints(2, 4), 0, 1, 1, DType.FLOAT16, Op.SUM, 0, 1024) == b""


def test_the_send_path_sends_what_due_says() -> None:
    """Two rounds alike, one asked `due` and one `due_packed`: first transmissions, then
    timeouts (queries), then a payload the appliance said never came (resent whole): the same
    transmissions, the same bytes."""
    def round_() -> AllreduceRound:
        return AllreduceRound(_endpoints(2, 4), 1, 3, 7, DType.BFLOAT16, Op.SUM, 40_000, 1024,
                              RttEstimator(), 0.0)

    decoded, packed = round_(), round_()
    for now in (0.0, 0.2, 0.6, 1.5):
        if now == 1.5:
            decoded.missing(1)
            packed.missing(1)
        want = decoded.due(now)
        got = packed.due_packed(now)
        assert want, now  # something left at every step: the comparison compared
        assert [transmit_of(p) for p in got] == want
        assert [bytes(p.header) for p in got] == [_packed(t.header) for t in want]
        assert [p.note is None for p in got] == [t.header.kind is Kind.CONTRIBUTION
                                                 for t in want]
    assert decoded.queries == packed.queries > 0
    assert decoded.nudged_retransmissions == packed.nudged_retransmissions == 1
