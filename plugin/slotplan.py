"""What a worker's rounds are cut into and sent to: the appliance cores (`Endpoint`), each
lane's share of their slots (`lane_endpoints`), the uses of their slots (`SlotUses`), a
round's number on the wire (`wire_round`), the numbering of what leaves for each core (`SendOrder`),
what leaves (`Transmit`, or `Packed` with its header already in wire bytes), and why what left
again did (`Repairs`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.wire import SERIALS, WRAP, Header, unpack

if TYPE_CHECKING:
    from .session import AllreduceRound

__all__ = ["Address", "Endpoint", "Packed", "Repairs", "SendOrder", "SlotUses", "Transmit",
           "lane_endpoints", "transmit_of", "wire_round"]

Address = tuple[str, int]


@dataclass(frozen=True)
class Endpoint:
    """One data-plane core of one appliance, as the job's registration described it."""

    address: Address
    job_id: int
    cookie: int
    slots: int
    name: str
    slot_base: int = 0  # this round uses slots slot_base .. slot_base + slots - 1 (its lane)
    appliance: int = 0  # which of the client's appliances the core belongs to


def lane_endpoints(endpoints: tuple[Endpoint, ...], lanes: int) -> list[tuple[Endpoint, ...]]:
    """Each lane's view of the endpoints: the same cores, a disjoint range of their slots."""
    if lanes < 1:
        raise ReductionError(f"lanes must be at least 1, not {lanes}")
    fewest = min(ep.slots for ep in endpoints)
    if lanes > fewest:
        raise ReductionError(
            f"{lanes} lanes need at least {lanes} slots per appliance core; the job has "
            f"{fewest} (raise jobs.slots in the appliance config, or use fewer lanes)")
    return [
        tuple(replace(ep, slot_base=ep.slot_base + ep.slots * lane // lanes,
                      slots=ep.slots * (lane + 1) // lanes - ep.slots * lane // lanes)
              for ep in endpoints)
        for lane in range(lanes)
    ]


def wire_round(count: int) -> int:
    """The header's number of an epoch's `count`-th round: 1..WRAP, then 1 again (a long job
    passes 2**32 rounds). Lanes follow the count, which never wraps: they take their turns
    across the wrap as everywhere (WRAP is odd: by the wire number, two rounds in a row would
    share a lane there)."""
    return (count - 1) % WRAP + 1


class Transmit(NamedTuple):
    endpoint: int
    segment: int
    header: Header
    ticket: int  # the round as its submitter knows it (see pipeline.RoundPipeline.submit)
    note: bytes  # a QUERY's payload (wire.Flags.SENT); a CONTRIBUTION's is the tensor's


class Packed(NamedTuple):
    """A `Transmit` as the worker's send path takes it: the header packed (wire bytes), and
    no note for a CONTRIBUTION, whose payload is the tensor's segment."""

    endpoint: int
    segment: int
    header: bytes | bytearray | memoryview  # wire.HEADER_SIZE bytes
    ticket: int
    note: bytes | None  # a QUERY's payload; None: the segment's bytes of the tensor


_new_tuple = tuple.__new__


def transmit_of(packed: Packed) -> Transmit:
    """The same transmission with its header decoded."""
    e, k, header, ticket, note = packed
    return _new_tuple(Transmit, (e, k, unpack(header), ticket, b"" if note is None else note))


class SlotUses:
    """How many times each slot has been used this epoch, by (endpoint, slot). Every rank runs
    the same rounds in the same order, so every rank numbers a slot's uses alike."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        # by endpoint << 32 | slot (slots are 32-bit on the wire), counted by
        # `AllreduceRound.due` at each first transmission: no tuple built per use
        self.counts: dict[int, int] = {}

    def reset(self) -> None:
        """A new epoch: every slot starts over."""
        self.counts.clear()


class SendOrder:
    """The send sequence (mod `SERIALS`) of a rank's first transmissions to each core, carried
    in their `serial` byte (wire.py), and the segment each number went with: a core that sees
    the numbers jump names the ones it never got (MISSING), and `sent` finds their segments.
    Shared by the rounds of one rank, as `SlotUses` is: a core numbers every round of the job
    as one stream. Kept across epochs: the core forgets its count on a new epoch."""

    __slots__ = ("next", "sent")

    def __init__(self, cores: int) -> None:
        self.next = [0] * cores
        # per core, per number: (round, segment) of the latest first transmission that
        # carried it
        self.sent: list[list[tuple[AllreduceRound, int] | None]] = [
            [None] * SERIALS for _ in range(cores)]

    def segments(self, core: int, numbers: bytes) -> list[tuple[AllreduceRound, int]]:
        """The (round, segment) each of `numbers` went with to `core` (a MISSING's payload),
        where one did."""
        sent = self.sent[core]
        return [found for number in numbers if (found := sent[number]) is not None]


class Repairs(NamedTuple):
    """A worker's retransmissions by the sign that sent each one again. Which sign dominates
    says what went wrong: `timer` with few `overtaken`, a rank or this process held up (a timer
    runs out while a late peer's contribution keeps the result back, or while this process
    was not running); `overtaken`, loss or reordering on the path; `told`, contributions that
    never reached the core."""

    overtaken: int = 0  # later segments to the same core were answered first (fast retransmit)
    told: int = 0  # a PENDING or MISSING said our contribution never came
    timer: int = 0  # its retransmission timer ran out
    queries: int = 0  # of all three, how many went as a header-only QUERY, not the payload

    @property
    def total(self) -> int:
        return self.overtaken + self.told + self.timer

    def plus(self, other: Repairs) -> Repairs:
        return Repairs(*(a + b for a, b in zip(self, other, strict=True)))
