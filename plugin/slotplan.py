"""What a worker's rounds are cut into and sent to: the appliance cores (`Endpoint`), the
uses of their slots (`SlotUses`), and what leaves for them (`Transmit`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from reduction_appliance.dataplane.wire import Header

__all__ = ["Address", "Endpoint", "SlotUses", "Transmit"]

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


class Transmit(NamedTuple):
    endpoint: int
    segment: int
    header: Header
    ticket: int  # the round as its submitter knows it (see pipeline.RoundPipeline.submit)


class SlotUses:
    """How many times each slot has been used this epoch, by (endpoint, slot). Every rank runs
    the same rounds in the same order, so every rank numbers a slot's uses alike."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[tuple[int, int], int] = {}

    def take(self, endpoint: int, slot: int) -> int:
        """The next use of `slot` on `endpoint` (1 for the first)."""
        key = (endpoint, slot)
        use = self._count.get(key, 0) + 1
        self._count[key] = use
        return use

    def reset(self) -> None:
        """A new epoch: every slot starts over."""
        self._count.clear()
