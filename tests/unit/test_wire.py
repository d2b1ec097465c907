"""The wire format against hand-written bytes and against an independent oracle (scapy).

`wire.py` packs with one struct; `dissect.py` declares the same layout as scapy fields. Golden
bytes pin both to the diagram, and hypothesis checks that they agree on every field's full range,
so a layout slip in either one cannot pass as long as the other is right.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw
from scapy.utils import rdpcap, wrpcap

from reduction_appliance.dataplane import wire
from reduction_appliance.dataplane.dissect import ReductionHeader, bind_port, unbind_port
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    MAGIC,
    VERSION,
    WRAP,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    WireError,
    next_number,
    number_before,
    pack_into,
    unpack,
)

U8, U16, U32, U64 = (2**8 - 1, 2**16 - 1, 2**32 - 1, 2**64 - 1)

# A port outside the default range, so that a test that forgets to unbind cannot be mistaken for
# the documented default binding.
TEST_PORT = 47000

# --- golden bytes ------------------------------------------------------------------------------
# Written by hand from the diagram in wire.py, one row of the diagram per line. Every field holds a
# value that differs from its neighbours' bytes, so a swapped, shifted or truncated field shows.

CONTRIBUTION_HEX = """
    5241 09 01     magic "RA", version 9, kind CONTRIBUTION
    03 02 00 5a    dtype BFLOAT16, op AVG, no flags, send sequence 90 (a first transmission)
    0a0b0c0d       job id
    1234 5678      rank, epoch
    deadbeef       cookie (high half)
    cafef00d       cookie (low half)
    00c0ffee       round
    0000abcd       slot
    00000012       offset (high half): above 4 GiB, so a 32-bit offset would show
    34567800       offset (low half)
    00001f40       length 8000
    00000007       use: the slot's 7th use this epoch
"""
CONTRIBUTION = Header(
    kind=Kind.CONTRIBUTION, dtype=DType.BFLOAT16, op=Op.AVG, flags=Flags.NONE,
    job_id=0x0A0B0C0D, rank=0x1234, cookie=0xDEADBEEFCAFEF00D, round=0x00C0FFEE, slot=0xABCD,
    offset=0x12_3456_7800, length=8000, use=7, epoch=0x5678, serial=90,
)

# A second golden with the top bit set in every wide field (catches signed packing).
PENDING_HEX = """
    5241 09 03     magic "RA", version 9, kind PENDING
    01 04 00 00    dtype FLOAT32, op MAX, no flags, zero
    fffffffe       job id
    ffff 8001      rank, epoch
    01234567       cookie (high half)
    89abcdef       cookie (low half)
    80000001       round
    7fffffff       slot
    ffffffff       offset (high half)
    ffffff00       offset (low half)
    00000004       length: a 4-byte rank bitmap
    80000003       use
"""
PENDING = Header(
    kind=Kind.PENDING, dtype=DType.FLOAT32, op=Op.MAX, flags=Flags.NONE, job_id=0xFFFFFFFE,
    rank=0xFFFF, cookie=0x0123456789ABCDEF, round=0x80000001, slot=0x7FFFFFFF,
    offset=0xFFFFFFFFFFFFFF00, length=4, use=0x80000003, epoch=0x8001,
)


# A QUERY ("the result, or say what you lack"): a contribution's header with no payload behind
# it, so `length` is the segment's length, not the datagram's.
QUERY_HEX = """
    5241 09 09     magic "RA", version 9, kind QUERY
    02 01 00 00    dtype FLOAT16, op SUM, no flags, zero
    00000021       job id
    0003 0002      rank, epoch
    00000000       cookie (high half)
    0000abcd       cookie (low half)
    00000005       round
    00000011       slot
    00000000       offset (high half)
    00010000       offset (low half)
    00002000       length 8192: the segment's
    00000009       use
"""
QUERY = Header(
    kind=Kind.QUERY, dtype=DType.FLOAT16, op=Op.SUM, flags=Flags.NONE, job_id=0x21, rank=3,
    cookie=0xABCD, round=5, slot=0x11, offset=0x10000, length=8192, use=9, epoch=2,
)

def from_annotated_hex(text: str) -> bytes:
    """The hex digits of each line up to the first word that is not hex (the comment)."""
    out = []
    for line in text.strip().splitlines():
        for word in line.split():
            if not all(c in "0123456789abcdef" for c in word):
                break
            out.append(word)
    return bytes.fromhex("".join(out))


GOLDEN = [
    pytest.param(from_annotated_hex(CONTRIBUTION_HEX), CONTRIBUTION, id="contribution"),
    pytest.param(from_annotated_hex(PENDING_HEX), PENDING, id="pending"),
    pytest.param(from_annotated_hex(QUERY_HEX), QUERY, id="query"),
]


def header_fields(h: Header) -> dict[str, int]:
    """`h` as plain ints keyed by field name: the same names the scapy layer uses."""
    return {name: int(value) for name, value in zip(Header._fields, h, strict=True)}


def scapy_fields(p: ReductionHeader) -> dict[str, int]:
    return {name: int(p.getfieldval(name)) for name in Header._fields}


def packed(h: Header) -> bytes:
    buf = bytearray(HEADER_SIZE)
    wire.pack_into(buf, h)
    return bytes(buf)


@pytest.mark.parametrize(("golden", "header"), GOLDEN)
def test_golden_bytes_are_one_header(golden: bytes, header: Header) -> None:
    assert len(golden) == HEADER_SIZE


@pytest.mark.parametrize(("golden", "header"), GOLDEN)
def test_pack_into_writes_golden_bytes(golden: bytes, header: Header) -> None:
    assert packed(header) == golden


@pytest.mark.parametrize(("golden", "header"), GOLDEN)
def test_unpack_decodes_golden_bytes(golden: bytes, header: Header) -> None:
    decoded = wire.unpack(golden)
    assert decoded == header
    # Decoded values are the enums, not bare ints, so callers can match on them.
    assert type(decoded.kind) is Kind
    assert type(decoded.dtype) is DType
    assert type(decoded.op) is Op


@pytest.mark.parametrize(("golden", "header"), GOLDEN)
def test_scapy_layer_agrees_with_golden_bytes(golden: bytes, header: Header) -> None:
    assert bytes(ReductionHeader(**header_fields(header))) == golden
    dissected = ReductionHeader(golden)
    assert scapy_fields(dissected) == header_fields(header)
    assert (dissected.magic, dissected.version) == (MAGIC, VERSION)


# A LIVENESS payload: three SILENT records, the second for a rank that left the job, the third
# for one whose process ended (its host said its port is closed).
LIVENESS_HEX = """
    0003 9ca4      rank 3, port 40100
    c6120065       address 198.18.0.101
    00001f40       silent 8000 ms
    8007 9ca5      L set: rank 7 left; port 40101
    c6120066       address 198.18.0.102
    0000157c       silent 5500 ms
    4002 9ca6      C set: rank 2 ended; port 40102
    c6120067       address 198.18.0.103
    000004b0       silent 1200 ms
"""


def test_a_liveness_payload_says_which_rank_left_ended_or_went_quiet() -> None:
    records = [wire.SilentRank(3, ("198.18.0.101", 40100), 8.0),
               wire.SilentRank(7, ("198.18.0.102", 40101), 5.5, left=True),
               wire.SilentRank(2, ("198.18.0.103", 40102), 1.2, closed=True)]
    golden = from_annotated_hex(LIVENESS_HEX)
    assert wire.pack_silent(records) == golden
    assert wire.unpack_silent(golden) == records
    with pytest.raises(WireError, match="not whole records"):
        wire.unpack_silent(golden[:-1])


def test_pack_into_writes_only_its_window_at_an_offset() -> None:
    buf = bytearray(b"\xaa" * (HEADER_SIZE + 32))
    wire.pack_into(buf, CONTRIBUTION, at=16)
    assert buf[:16] == b"\xaa" * 16
    assert buf[16 : 16 + HEADER_SIZE] == from_annotated_hex(CONTRIBUTION_HEX)
    assert buf[16 + HEADER_SIZE :] == b"\xaa" * 16
    assert wire.unpack(buf, at=16) == CONTRIBUTION
    assert wire.unpack(memoryview(buf), at=16) == CONTRIBUTION


# --- round trips through the oracle -------------------------------------------------------------


def uint(bits: int) -> st.SearchStrategy[int]:
    """Any unsigned `bits`-bit value, with the edges drawn often.

    Spread over twelve fields, plain `st.integers` almost never sets a field's top bit, which is
    exactly where a signed or too-narrow field breaks; so the edges are drawn on purpose.
    """
    top = 2**bits - 1
    edges = [0, 1, top, top - 1, 2 ** (bits - 1), 2 ** (bits - 1) - 1]
    return st.one_of(st.sampled_from(edges), st.integers(0, top))


headers = st.builds(
    Header,
    kind=st.sampled_from(Kind),
    dtype=st.sampled_from(DType),
    op=st.sampled_from(Op),
    flags=uint(8),
    job_id=uint(32),
    rank=uint(16),
    cookie=uint(64),
    round=uint(32),
    slot=uint(32),
    offset=uint(64),
    length=uint(32),
    use=uint(32),
    epoch=uint(16),
    serial=uint(8),
)


# No per-example deadline: scapy builds packets in pure Python, and CI shares two cores with other
# work, so a slow example says nothing about the wire format.
@settings(deadline=None, max_examples=500)
@given(headers, st.binary(max_size=64))
def test_wire_bytes_dissect_in_scapy(h: Header, payload: bytes) -> None:
    dissected = ReductionHeader(packed(h) + payload)
    assert scapy_fields(dissected) == header_fields(h)
    assert (dissected.magic, dissected.version) == (MAGIC, VERSION)
    assert bytes(dissected.payload) == payload


@settings(deadline=None, max_examples=500)
@given(headers)
def test_scapy_bytes_unpack_in_wire(h: Header) -> None:
    raw = bytes(ReductionHeader(**header_fields(h)))
    assert raw == packed(h)
    assert wire.unpack(raw) == h


# --- rejection -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, HEADER_SIZE - 1])
def test_short_datagram_is_rejected(size: int) -> None:
    with pytest.raises(WireError, match="shorter than the header"):
        wire.unpack(packed(CONTRIBUTION)[:size])


def test_header_cut_short_by_the_offset_is_rejected() -> None:
    buf = packed(CONTRIBUTION) + bytes(8)
    with pytest.raises(WireError, match="shorter than the header"):
        wire.unpack(buf, at=9)


@settings(deadline=None)
@given(st.integers(0, U16).filter(lambda m: m != MAGIC))
def test_bad_magic_is_rejected(magic: int) -> None:
    with pytest.raises(WireError, match="magic"):
        wire.unpack(bytes(ReductionHeader(magic=magic)))


@settings(deadline=None)
@given(st.integers(0, U8).filter(lambda v: v != VERSION))
def test_bad_version_is_rejected(version: int) -> None:
    with pytest.raises(WireError, match="version"):
        wire.unpack(bytes(ReductionHeader(version=version)))


@pytest.mark.parametrize(
    ("field", "known"),
    [("kind", {int(k) for k in Kind}), ("dtype", {int(d) for d in DType}),
     ("op", {int(o) for o in Op})],
)
@pytest.mark.parametrize("value", range(U8 + 1))
def test_unknown_enum_value_is_rejected(field: str, known: set[int], value: int) -> None:
    # All 256 values, built by the oracle: exactly the named ones decode, the rest are refused.
    raw = bytes(ReductionHeader(**{field: value}))
    if value in known:
        assert int(getattr(wire.unpack(raw), field)) == value
    else:
        with pytest.raises(WireError, match="unknown kind/dtype/op"):
            wire.unpack(raw)


# --- whole packets, as an operator sees them ----------------------------------------------------


@pytest.fixture
def bound_port() -> Iterator[int]:
    # scapy's layer bindings are process-global: leave them as we found them.
    bind_port(TEST_PORT)
    try:
        yield TEST_PORT
    finally:
        unbind_port(TEST_PORT)


def contribution_packet(port: int, values: np.ndarray) -> Packet:
    payload = values.tobytes()
    h = CONTRIBUTION._replace(dtype=DType.FLOAT32, length=len(payload))
    return (
        IP(src="10.0.0.2", dst="10.0.0.1")
        / UDP(sport=40001, dport=port)
        / ReductionHeader(**header_fields(h))
        / Raw(payload)
    )


def test_udp_ip_packet_with_payload_dissects_back(bound_port: int) -> None:
    values = np.arange(256, dtype=np.float32) * np.float32(0.5)
    back = IP(bytes(contribution_packet(bound_port, values)))

    assert ReductionHeader in back
    h = wire.unpack(bytes(back[ReductionHeader]))
    assert h.kind is Kind.CONTRIBUTION
    assert h.length == values.nbytes
    assert back[UDP].len == 8 + HEADER_SIZE + values.nbytes
    np.testing.assert_array_equal(np.frombuffer(back[Raw].load, dtype=np.float32), values)


def test_result_from_the_appliance_port_dissects(bound_port: int) -> None:
    # Results travel *from* the bound port to a worker's ephemeral port.
    pkt = (
        IP(src="10.0.0.1", dst="10.0.0.2")
        / UDP(sport=bound_port, dport=40001)
        / ReductionHeader(kind=Kind.RESULT, length=4)
        / Raw(b"\x00\x00\x80\x3f")
    )
    back = IP(bytes(pkt))
    assert back[ReductionHeader].kind == Kind.RESULT
    assert back[Raw].load == b"\x00\x00\x80\x3f"


def test_binding_sets_the_destination_port_when_building(bound_port: int) -> None:
    assert UDP(bytes(UDP() / ReductionHeader())).dport == bound_port


def test_unbound_port_is_not_dissected() -> None:
    raw = bytes(contribution_packet(TEST_PORT, np.zeros(4, dtype=np.float32)))
    bind_port(TEST_PORT)
    unbind_port(TEST_PORT)
    assert ReductionHeader not in IP(raw)


def test_operator_dissects_a_capture_file(bound_port: int, tmp_path: Path) -> None:
    # The workflow from dissect.py's docstring: write a capture, read it back with rdpcap.
    values = np.linspace(-1, 1, 64, dtype=np.float32)
    frame = Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01") / contribution_packet(
        bound_port, values
    )
    path = tmp_path / "appliance.pcap"
    wrpcap(str(path), [frame])

    (pkt,) = rdpcap(str(path))
    assert ReductionHeader in pkt
    assert wire.unpack(bytes(pkt[ReductionHeader])).length == values.nbytes
    assert "CONTRIBUTION" in pkt[ReductionHeader].summary()
    np.testing.assert_array_equal(np.frombuffer(pkt[Raw].load, dtype=np.float32), values)


def test_round_and_use_numbers_wrap_at_the_header_field() -> None:
    """Rounds and slot uses run 1..WRAP, then 1 again (0: none yet); one comes before another
    within half the cycle, across the wrap too."""
    assert WRAP == 2**32 - 1
    assert [next_number(n) for n in (0, 1, WRAP - 1, WRAP)] == [1, 2, WRAP, 1]
    assert number_before(WRAP, 1) and number_before(WRAP - 5, 3) and number_before(4, 9)
    assert not number_before(1, WRAP) and not number_before(9, 4) and not number_before(7, 7)
    h = Header(Kind.CONTRIBUTION, DType.FLOAT32, Op.SUM, 0, 1, 0, 2, WRAP, 0, 0, 4, WRAP, 1)
    buf = bytearray(HEADER_SIZE)
    pack_into(buf, h)
    assert unpack(bytes(buf) + bytes(4)) == h
