"""A coalesced receive of results taken whole: the worker's burst path (dataplane/runs.py is
the appliance's).

With UDP GRO a worker's receive holds up to 64 KB of consecutive datagrams from one core, and
on a clean network nearly all of them are results of one round, each wanted once. Decoding
each into a `Header` and offering it to `AllreduceRound.accept` would cost a NamedTuple and a
dozen attribute lookups per result; here each is one struct unpacking, the round's checks
(`AllreduceRound.wanted`) and one copy from the receive buffer into the round's array, where
the caller's tensor lives. Sans-I/O: bytes in, the round's state and the array updated."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reduction_appliance.dataplane.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    SERIAL_AT,
    VERSION,
    Flags,
    Kind,
)

from .slotplan import Address

if TYPE_CHECKING:
    from .session import AllreduceRound

__all__ = ["take_results"]

QUEUED = int(Flags.QUEUED)


def take_results(rnd: AllreduceRound, buf: bytearray, view: memoryview, start: int,
                 nbytes: int, size: int, source: Address, now: float, out: memoryview) -> int:
    """Store the results of round `rnd` that a coalesced receive holds from `start` on
    (datagrams `size` bytes apart, from `source`) straight into `out`, the round's array.
    Stops at the first datagram that is anything else (a duplicate, a notice, another round's,
    a malformed one) and returns where it begins, for the caller to decode the usual way;
    `nbytes` when it took them all."""
    unpack_from = HEADER.unpack_from
    wanted, stored = rnd.wanted, rnd.stored
    for at in range(start, nbytes, size):
        end = at + size if at + size < nbytes else nbytes
        if end - at < HEADER_SIZE:
            return at
        (magic, version, kind, dtype, _, flags, job_id, completer, epoch, cookie, round_no, _,
         offset, length, use) = unpack_from(buf, at)
        if (magic != MAGIC or version != VERSION or kind != Kind.RESULT
                or end - at != HEADER_SIZE + length):
            return at
        k = wanted(dtype, job_id, cookie, round_no, offset, length, use, epoch,
                   buf[at + SERIAL_AT], source)
        if k is None:
            return at
        out[offset:offset + length] = view[at + HEADER_SIZE:end]
        stored(k, now, completer, flags & QUEUED)
    return nbytes
