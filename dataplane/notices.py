"""The notices an aggregator sends besides results, built as data (sans-I/O): PENDING to a rank
that asks after an unfinished segment (and to the ranks whose contribution it lacks), a notice
to every bound rank of a job (and what a DIVERGED one says), and a notice answering one
datagram; whether a query for a finished result hears PENDING because the result is still on
its way; and the flags a RESULT carries, as sent to all (`echoed`) and as resent to one rank
(`resent`). The caller counts them."""

from __future__ import annotations

from .slotstate import JobState, SlotCopy
from .spec import Address
from .transport import Send
from .wire import (
    FLAGS_AT,
    HEADER_SIZE,
    SERIALS,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
    serial_newer,
)

__all__ = ["RESULT_IN_FLIGHT_S", "RESULT_QUEUED_S", "answer", "divergence", "echoed",
           "lost_on_the_way", "on_its_way", "pending_notes", "resent", "to_every_rank"]

# A PROBE (wire.Flags) for a result that left less than this long ago gets a PENDING note: the
# result is taken to be on its way. No longer than the workers' RTO floor (Timing.rto_min), so a
# probe's retry, an RTO later, gets the result: a result really lost costs one more RTO at most.
RESULT_IN_FLIGHT_S = 0.01
# ... and a result the worker's query shows queued: it has heard neither this result nor the one
# this core sent before it (wire.Flags.SERIAL). Results to a worker keep their order on its path,
# so both are on their way (two lost in a row is far rarer than a queue), and resending would
# only queue a copy behind the original; a queue that held results longer than 10 ms made
# every resend a duplicate that lengthened it (docs/benchmarks-journal.md). The limit bounds
# what a lost last result costs when the one before it was lost too: each is asked after again.
RESULT_QUEUED_S = 0.1
_ECHOED = int(Flags.QUEUED | Flags.REPAIRED)  # what a RESULT echoes of its completer's flags
_REPAIRED = int(Flags.REPAIRED)


def on_its_way(copy: SlotCopy, h: Header, age: float) -> bool:
    """Is the result of `copy`, `age` seconds after it left, still on its way to the worker
    whose query `h` asks after it (then the worker hears PENDING, not the result again)? With
    the newest serial that worker heard from this core (SERIAL): when it is older than the
    result's, for `RESULT_IN_FLIGHT_S`, and for `RESULT_QUEUED_S` when an earlier result is
    unheard too (a queue). Without one: for `RESULT_IN_FLIGHT_S`, if the query is a stall's
    PROBE."""
    if not h.flags & Flags.SERIAL:
        return bool(h.flags & Flags.PROBE) and age < RESULT_IN_FLIGHT_S
    if not serial_newer(copy.serial, h.serial):
        return False  # it heard this one or a later one: lost
    lacks = (copy.serial - h.serial) % SERIALS  # the results it lacks, up to this one
    return age < (RESULT_QUEUED_S if lacks > 1 else RESULT_IN_FLIGHT_S)


def lost_on_the_way(copy: SlotCopy, h: Header) -> bool:
    """Is the result of `copy`, asked after again by `h`, known to have been lost on its way,
    not late or unread? It is when that worker heard a later result of this core (SERIAL):
    results travel one path in order. A query without that proof (a timer ran out while the
    worker's process was not running, or while the result sat unread in its socket) says
    nothing about the path: a busy host's ranks asked again for 3-6% of their results on a
    clean rack."""
    return bool(h.flags & Flags.SERIAL) and serial_newer(h.serial, copy.serial)


def pending_notes(job: JobState, copy: SlotCopy, h: Header, source: Address) -> list[Send]:
    """A rank asks after an unfinished segment (it retransmitted, or queried): tell it which
    ranks have arrived, and tell each missing rank that has sent data since the segment began
    here (so it is in this round, and its contribution was lost) that it never came, so that it
    resends now rather than at its own timer (its later segments may be waiting on other holes,
    so it may not see this one for a while). A rank silent since then is still computing:
    telling it would only add datagrams while it is late."""
    spec = job.spec
    bitmap = copy.arrived.to_bytes((spec.world_size + 7) // 8, "little")
    header = bytearray(HEADER_SIZE)
    pack_into(header, Header(
        Kind.PENDING, copy.dtype, copy.op, 0, spec.job_id, h.rank, spec.cookie,
        copy.round, h.slot, copy.offset, len(bitmap), copy.use, spec.epoch,
    ))
    sends = [Send(source, header, bitmap)]
    missing = job.all_ranks & ~copy.arrived
    rank = 0
    started = copy.started
    while missing:
        if (missing & 1 and job.last_data[rank] > started
                and (address := spec.endpoints[rank]) is not None):
            sends.append(Send(address, header, bitmap))
        missing >>= 1
        rank += 1
    return sends


def to_every_rank(job: JobState, kind: Kind, payload: bytes, flags: int = 0,
                  skip: frozenset[int] = frozenset()) -> list[Send]:
    """A notice of `kind`, flagged `flags`, to every bound rank of the job but those in
    `skip`, in its current epoch."""
    spec = job.spec
    notices = []
    for rank, address in enumerate(spec.endpoints):
        if address is not None and rank not in skip:
            header = bytearray(HEADER_SIZE)
            pack_into(header, Header(kind, DType.FLOAT32, Op.SUM, flags, spec.job_id, rank,
                                     spec.cookie, job.rounds, 0, 0, len(payload), 0,
                                     spec.epoch))
            notices.append(Send(address, header, payload))
    return notices


def answer(kind: Kind, h: Header, dest: Address, epoch: int, payload: bytes = b"") -> Send:
    """A notice of `kind` answering the datagram whose header is `h`, in `epoch`."""
    header = bytearray(HEADER_SIZE)
    pack_into(header, h._replace(kind=kind, length=len(payload), flags=0, epoch=epoch, serial=0))
    return Send(dest, header, payload)


def resent(header: bytearray | memoryview) -> bytearray:
    """A RESULT's header as resent to one rank that asked: flagged RETRANSMIT, so that the
    rank knows it got the result after its peers (plugin/pipeline.py: its next round starts
    late)."""
    again = bytearray(header)
    again[FLAGS_AT] |= Flags.RETRANSMIT
    return again


def echoed(flags: int) -> int:
    """The flags a RESULT carries when a contribution with `flags` completes it: its QUEUED
    and REPAIRED, and REPAIRED for a retransmission (wire.py: no rank samples that round
    trip)."""
    return flags & _ECHOED | (_REPAIRED if flags & Flags.RETRANSMIT else 0)


def divergence(job: JobState, copy: SlotCopy, h: Header) -> str:
    """What a DIVERGED notice says: `h` names another segment for the use `copy` holds."""
    first = next((r for r in range(job.spec.world_size) if copy.arrived >> r & 1), None)
    theirs = "the other ranks" if first is None else f"rank {first}"
    return (f"ranks diverged at slot {h.slot} use {h.use} (epoch {job.spec.epoch}): rank "
            f"{h.rank} sent round {h.round} offset {h.offset} length {h.length} {h.dtype.name} "
            f"{h.op.name}, {theirs} sent {copy.describe()}: {copy.disagreement(h)}; "
            "resynchronise the job (re-join, or resync) to continue")
