"""A scapy layer for the reduction header: an operator's dissector and the tests' oracle.

The 48-byte layout is declared here a second time, field by field, on purpose: `wire.py` packs
with one precompiled struct for speed, and this module states the same layout as scapy fields,
written independently of that struct. The tests check that the two agree byte for byte, so a slip
in either shows up as a disagreement instead of a protocol silently shared by two wrong peers.
Only the enums' names and the two constants are taken from `wire.py`, so that a capture prints
``CONTRIBUTION``/``BFLOAT16``/``SUM`` exactly as the code spells them.

Nothing is bound to UDP at import: the appliance's ports come from its configuration, and a
global binding on import would make every UDP datagram to that port look like ours in any program
that happens to import this module. An operator binds the ports of the deployment explicitly::

    from scapy.all import rdpcap
    from reduction_appliance.dataplane.dissect import ReductionHeader, bind_port

    bind_port(7000)                      # or bind_default_ports() for 7000-7063
    for pkt in rdpcap("appliance.pcap"):
        if ReductionHeader in pkt:
            h = pkt[ReductionHeader]
            print(h.summary(), h.job_id, h.rank, h.round, h.offset, len(h.payload))

A capture to feed it: ``tcpdump -i eth1 -w appliance.pcap udp portrange 7000-7063``.
"""

from __future__ import annotations

from typing import ClassVar

from scapy.fields import (
    AnyField,
    ByteEnumField,
    ByteField,
    FlagsField,
    IntField,
    LongField,
    ShortField,
    XShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, Raw, bind_bottom_up, bind_layers, split_bottom_up, split_layers

from reduction_appliance.dataplane.wire import MAGIC, VERSION, DType, Flags, Kind, Op

__all__ = [
    "DEFAULT_PORTS",
    "ReductionHeader",
    "bind_default_ports",
    "bind_port",
    "unbind_port",
]

# The documented default: one UDP port per data-plane core, 64 cores at most per appliance.
DEFAULT_PORTS = range(7000, 7064)


class ReductionHeader(Packet):
    """The reduction header; everything after it in the datagram is the payload (`Raw`).

    Field order and widths mirror the diagram in `dataplane.wire`; every field is big-endian.
    """

    name = "ReductionHeader"
    fields_desc: ClassVar[list[AnyField]] = [
        XShortField("magic", MAGIC),  # 0
        ByteField("version", VERSION),  # 2
        ByteEnumField("kind", Kind.CONTRIBUTION, {int(k): k.name for k in Kind}),  # 3
        ByteEnumField("dtype", DType.FLOAT32, {int(d): d.name for d in DType}),  # 4
        ByteEnumField("op", Op.SUM, {int(o): o.name for o in Op}),  # 5
        FlagsField("flags", 0, 8, {int(f): str(f.name) for f in Flags if f}),  # 6
        ByteField("serial", 0),  # 7: a RESULT's serial, or a SERIAL QUERY's newest seen
        IntField("job_id", 0),  # 8
        ShortField("rank", 0),  # 12
        ShortField("epoch", 0),  # 14: the job's epoch
        LongField("cookie", 0),  # 16
        IntField("round", 0),  # 24
        IntField("slot", 0),  # 28
        LongField("offset", 0),  # 32: byte offset of the segment in the tensor
        IntField("length", 0),  # 40: payload length in bytes
        IntField("use", 0),  # 44: the slot's use number within the epoch
    ]

    def guess_payload_class(self, payload: bytes) -> type[Packet]:
        # The payload is tensor bytes or a rank bitmap, never another protocol: do not let
        # scapy's heuristics try to find one in it.
        return Raw

    def mysummary(self) -> str:
        # One line per datagram in `pkts.summary()`: what it is and which segment it names.
        return str(
            self.sprintf(
                "ReductionHeader %kind% %dtype% %op% job=%job_id% rank=%rank% "
                "epoch=%epoch% round=%round% slot=%slot% use=%use% off=%offset% len=%length%"
            )
        )


def bind_port(port: int) -> None:
    """Dissect UDP datagrams to or from `port` as reduction traffic.

    Both directions are bound because contributions go *to* the appliance's port while results
    come back *from* it to a worker's ephemeral port. Building `UDP()/ReductionHeader()` sets
    `dport` to the port bound last.
    """
    bind_layers(UDP, ReductionHeader, dport=port)
    bind_bottom_up(UDP, ReductionHeader, sport=port)


def unbind_port(port: int) -> None:
    """Undo `bind_port(port)`, e.g. so that a test leaves scapy's global tables as it found them."""
    split_layers(UDP, ReductionHeader, dport=port)
    split_bottom_up(UDP, ReductionHeader, sport=port)


def bind_default_ports() -> None:
    """Bind every port of `DEFAULT_PORTS`, for captures from a default-configured appliance."""
    for port in DEFAULT_PORTS:
        bind_port(port)
