"""The notices an aggregator sends besides results, built as data (sans-I/O): PENDING to a rank
that asks after an unfinished segment (and to the ranks whose contribution it lacks), a notice
to every bound rank of a job, and a notice answering one datagram. The caller counts them."""

from __future__ import annotations

from .slotstate import JobState, SlotCopy
from .spec import Address
from .transport import Send
from .wire import HEADER_SIZE, DType, Header, Kind, Op, pack_into

__all__ = ["answer", "pending_notes", "to_every_rank"]


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


def to_every_rank(job: JobState, kind: Kind, payload: bytes) -> list[Send]:
    """A notice of `kind` to every bound rank of the job, in its current epoch."""
    spec = job.spec
    notices = []
    for rank, address in enumerate(spec.endpoints):
        if address is not None:
            h = Header(kind, DType.FLOAT32, Op.SUM, 0, spec.job_id, rank, spec.cookie,
                       job.rounds, 0, 0, len(payload), 0, spec.epoch)
            notices.append(answer(kind, h, address, spec.epoch, payload))
    return notices


def answer(kind: Kind, h: Header, dest: Address, epoch: int, payload: bytes = b"") -> Send:
    """A notice of `kind` answering the datagram whose header is `h`, in `epoch`."""
    header = bytearray(HEADER_SIZE)
    pack_into(header, h._replace(kind=kind, length=len(payload), flags=0, epoch=epoch, serial=0))
    return Send(dest, header, payload)
