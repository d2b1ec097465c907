"""Sans-I/O aggregation core of one data-plane core: datagrams in, datagrams to send out.

No sockets, no clock: the transport hands in an `RxBatch` (datagrams already in receive-pool
buffers, and coalesced receives left in its staging buffers, with their sources) and the time,
and gets back a list of `Send` decisions to apply. A coalesced receive is taken in bursts
(`dataplane.runs`); a datagram that breaks a burst goes datagram by datagram like the others.

Slot protocol (after SwitchML, without its limits):

* Every rank numbers the uses of each slot alike (`use` 1, 2, ... within an epoch): a worker
  sends a slot's next segment only after it received the result of the previous one. So the only
  uses a slot may see are its current one, the one before (a late retransmission: answered from
  the other copy) and the next one. Anything else is outside the window and is dropped before it
  can occupy a slot (`DROP_WINDOW`, or `DROP_STALE` for the past).
* Each slot has two copies. The newest use fills one copy while the other keeps the previous
  result, so a late retransmission of a finished segment is answered (unicast, to that worker)
  from the stored result: that worker missed the multicast. Unless the result is on its way:
  the query's newest serial (the results a worker heard from this core, in order) is older
  than the result's and it left less than `RESULT_IN_FLIGHT_S` ago, or `RESULT_QUEUED_S` when
  the worker lacks an earlier result too (a queue; a query without a serial: a stall's PROBE,
  `RESULT_IN_FLIGHT_S`). Then the worker hears PENDING instead.
* A rank bitmap per copy gives exactly-once accumulation: a duplicate never adds twice.
* Ranks are bound to the endpoint they joined from (the control plane says, `JobSpec.endpoints`):
  a contribution from any other source is dropped (`DROP_BAD_SOURCE`), results and notices go
  only to bound endpoints, and nothing a datagram says can move them.
* A use whose tag (round, offset, length, dtype, op) differs between ranks means the ranks
  diverged (a round lost on some of them): the job is marked diverged and every rank is told
  (DIVERGED, with the reason) instead of waiting forever; a new epoch (a re-join, or a resync
  the ranks ask for) clears it. A datagram of an older epoch is answered with RESYNC.
* Deterministic mode sums in rank order: a contribution that arrives ahead of its turn is held
  in its receive buffer (no copy, ownership moves) until the ranks before it are in, within the
  job's own quota of held buffers (`JobSpec.hold_buffers`), so no job can starve another.
* Liveness: every datagram a bound rank sends (a contribution, or the HEARTBEAT its worker
  sends several times per liveness timeout even while it computes) marks it alive. A HEARTBEAT
  is answered with LIVENESS listing the ranks silent longer than `JobSpec.liveness_timeout`
  (and at once a rank that left, or whose process ended, while a use here waits for it: it
  fell silent and its host said its port is closed, `dataplane.reach`), so every rank
  learns within a heartbeat that a peer died; and an answer at all tells the worker the
  appliance lives.
  A PATH_PROBE is echoed at the size it asks for (a joining worker's test of its path), and
  a HEARTBEAT of a job this core lacks hears UNKNOWN_JOB (`dataplane.upkeep`): the appliance
  restarted without it, or the job ended. A draining job (the appliance stopping) begins no
  round after its fence (`dataplane.fence`).

The states of a slot copy and their transition table live in `slotstate`.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from numpy.typing import NDArray

from .counters import Counter, Counters
from .errors import AdmissionError, PeerError
from .fence import fenced_out, raise_fence
from .gaps import forget_sequences, note_sent, note_sequence
from .notices import (
    answer,
    divergence,
    echoed,
    lost_on_the_way,
    on_its_way,
    pending_notes,
    resent,
    to_every_rank,
)
from .reach import refused, tend
from .reduce import KernelTable, SegmentKernel
from .runs import RunPath
from .slots import RxPool, SlotArena, holdable_buffers, receive_reserve
from .slotstate import CopyState, Event, JobState, Slot, SlotCopy, move
from .spec import Address, Fenced, JobSpec, JobStats
from .transport import RxBatch, Send
from .upkeep import UNKNOWN_JOB_NOTICES_PER_S, Budget, heartbeat, lacks, path_echo, unknown_job
from .wire import (
    HEADER,
    HEADER_SIZE,
    ITEMSIZE,
    MAGIC,
    SERIAL_AT,
    SERIALS,
    VERSION,
    DType,
    Flags,
    Header,
    Kind,
    WireError,
    next_number,
    number_before,
    unpack,
)

__all__ = ["Aggregator", "CopyState"]


_TOMBSTONES = 1024  # aborted jobs remembered, so their workers hear why instead of timing out
ABORT_REASON_MAX = 512  # bytes of an ABORTED notice's reason: it fits any datagram


class Aggregator:
    """All jobs of one core. Single-threaded: the core's poll loop is the only caller."""

    def __init__(self, arena: SlotArena, kernels: KernelTable, counters: Counters) -> None:
        self._arena = arena
        self._pool = arena.rx
        self._kernels = kernels
        self.counters = counters
        self._jobs: dict[int, JobState] = {}
        # aborted job id -> (cookie, its bound endpoints, why): notices go to those only
        self._aborted: OrderedDict[int, tuple[int, frozenset[Address], bytes]] = OrderedDict()
        self._cells = counters.cells
        self._reserve = receive_reserve(len(self._pool))
        self._unknown_budget = Budget(UNKNOWN_JOB_NOTICES_PER_S)
        self._runs = RunPath(self._jobs, arena, kernels, counters, self._finish, self._one)

    # ---- job table (driven by the control plane through the mailbox) ----
    def add_job(self, spec: JobSpec, now: float) -> list[Send]:
        if spec.job_id in self._jobs:
            raise AdmissionError(f"job {spec.job_id} already exists on this core")
        if spec.world_size < 1 or spec.slots < 1 or len(spec.endpoints) != spec.world_size:
            raise AdmissionError(f"job {spec.job_id}: world size and slots must be >= 1 and "
                                 "every rank needs an endpoint entry")
        reserved = sum(j.spec.hold_buffers for j in self._jobs.values())
        holdable = holdable_buffers(len(self._pool))
        if reserved + spec.hold_buffers > holdable:
            raise AdmissionError(
                f"job {spec.job_id} needs {spec.hold_buffers} held receive buffers but only "
                f"{holdable - reserved} of {holdable} are unreserved on this core")
        arena_slots = self._arena.allocate(spec.slots)
        slots = [
            Slot((
                SlotCopy(i, *self._arena.copy_buffers(s, 0), copy=0),
                SlotCopy(i, *self._arena.copy_buffers(s, 1), copy=1),
            ))
            for i, s in enumerate(arena_slots)
        ]
        self._jobs[spec.job_id] = JobState(spec, arena_slots, slots, now)
        self._cells[Counter.SLOTS_IN_USE] += spec.slots
        return []

    def update_job(self, spec: JobSpec, now: float) -> list[Send]:
        """New endpoints (a rank joined or re-joined), ranks that left (`departed`), or a new
        epoch (every slot starts empty again; every bound worker is told with RESYNC)."""
        job = self._jobs.get(spec.job_id)
        if job is None:
            return self.add_job(spec, now)
        old = job.spec
        if (spec.cookie, spec.world_size, spec.slots) != (old.cookie, old.world_size,
                                                           old.slots):
            raise AdmissionError(f"job {spec.job_id}: only endpoints and epoch may change")
        job.spec = spec
        for rank, (was, now_at) in enumerate(zip(old.endpoints, spec.endpoints, strict=True)):
            if was != now_at:
                job.last_seen[rank] = job.beats[rank] = now  # a rank that (re-)joined is alive
                job.elsewhere.pop(rank, None)
                forget_sequences(job, rank)  # and numbers its contributions afresh
        if spec.epoch == old.epoch:
            return []
        job.empty_slots(self._pool)
        forget_sequences(job)
        return self._tell(job, Kind.RESYNC, b"")

    def abort_job(self, job_id: int, reason: str = "") -> list[Send]:
        """Remove the job: tell every bound worker (ABORTED, saying `reason`), and answer later
        datagrams of the job from those endpoints the same way, so workers fail at once, not at
        their deadline, and know why."""
        job = self._jobs.get(job_id)
        if job is None:
            return []
        why = reason.encode()[:ABORT_REASON_MAX].decode(errors="ignore").encode()
        self._aborted[job_id] = (job.spec.cookie, frozenset(job.bound), why)
        while len(self._aborted) > _TOMBSTONES:
            self._aborted.popitem(last=False)
        self.remove_job(job_id)
        notices = self._tell(job, Kind.ABORTED, why, counter=Counter.ABORT_NOTICES)
        return notices

    def remove_job(self, job_id: int) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        for slot in job.slots:
            for copy in slot.copies:
                job.release_held(copy, self._pool)
        self._arena.release(job.arena_slots)
        self._cells[Counter.SLOTS_IN_USE] -= job.spec.slots

    def fence(self, job_id: int, floor: int, now: float,
              ended: frozenset[int] = frozenset()) -> Fenced | None:
        """Drain the job: no round after its fence starts here (`dataplane.fence`); `ended`:
        its ranks other cores found ended."""
        job = self._jobs.get(job_id)
        return None if job is None else raise_fence(job, floor, now, ended)

    def reach(self, closed: list[Address], now: float) -> list[Send]:
        """Mark the ranks whose endpoints were found `closed`; REACH the ranks a slot waits for
        that are overdue, and tell the others of those that ended (`dataplane.reach`)."""
        jobs = self._jobs.values()
        if closed:
            refused(jobs, closed, now, self._cells)
        return [send for job in jobs for send in tend(job, now, self._cells)]

    @property
    def pool(self) -> RxPool:
        """The receive buffers transports must receive into (ours: see `on_batch`)."""
        return self._pool

    @property
    def job_ids(self) -> list[int]:
        return list(self._jobs)

    def stats(self, job_id: int, now: float) -> JobStats | None:
        job = self._jobs.get(job_id)
        return None if job is None else job.stats(now)

    # ---- datagram path ----
    def on_batch(self, batch: RxBatch, now: float) -> list[Send]:
        """Take in the datagrams of `batch` (their buffers are ours now: each goes back to the
        pool unless a deterministic job holds it; its runs' staging is lent to us until the
        transport's next receive) and return what to send."""
        out: list[Send] = []
        for index, nbytes, source in zip(batch.index, batch.nbytes, batch.source, strict=True):
            self._one(index, nbytes, source, now, out)
        take_run = self._runs.take
        for staging, nbytes, size, source in batch.runs:
            take_run(staging, nbytes, size, source, now, out)
        return out

    def _one(self, index: int, nbytes: int, source: Address, now: float,
             out: list[Send]) -> None:
        """Take in one datagram, sitting in receive buffer `index`, every check on the way."""
        pool = self._pool
        cells = self._cells
        try:
            if nbytes < HEADER_SIZE:  # the buffer's header bytes are someone else's
                raise WireError(f"datagram of {nbytes} bytes is shorter than the header")
            h = unpack(pool.views[index])
        except PeerError:
            cells[Counter.DROP_MALFORMED] += 1
            pool.release(index)
            return
        if h.kind is Kind.CONTRIBUTION or h.kind is Kind.QUERY:
            if not self._contribution(h, index, nbytes - HEADER_SIZE, source, now, out):
                pool.release(index)
            return
        if h.kind is Kind.HEARTBEAT or h.kind is Kind.PATH_PROBE:
            self._upkeep(h, nbytes - HEADER_SIZE, source, now, out)
        else:
            cells[Counter.DROP_MALFORMED] += 1
        pool.release(index)

    def _upkeep(self, h: Header, received: int, source: Address, now: float,
                out: list[Send]) -> None:
        """A HEARTBEAT or a PATH_PROBE (dataplane.upkeep): answered for a bound rank; a
        heartbeat of a job this core lacks hears UNKNOWN_JOB."""
        job = self._member(h, source, out)
        if job is None:
            if h.kind is Kind.HEARTBEAT and lacks(self._jobs, self._aborted, h):
                notice = unknown_job(h, source, now, self._unknown_budget, self._cells)
                if notice is not None:
                    out.append(notice)
            return
        if h.kind is Kind.HEARTBEAT:
            out.append(heartbeat(job, h, source, now, self._cells))
            return
        echo = path_echo(job, h, received, source, now, self._arena.max_payload, self._cells)
        if echo is not None:
            out.append(echo)

    def _contribution(self, h: Header, index: int, received: int, source: Address,
                      now: float, out: list[Send]) -> bool:
        """Handle one contribution (or a QUERY: its header alone) whose datagram sits in
        buffer `index`; True when a deterministic job keeps that buffer."""
        cells = self._cells
        job = self._member(h, source, out)
        if job is None:
            return False
        spec = job.spec
        job.last_seen[h.rank] = now
        if h.epoch != spec.epoch:
            cells[Counter.DROP_EPOCH] += 1
            cells[Counter.JOB_NOTICES] += 1
            out.append(self._notice(Kind.RESYNC, h, source))
            return False
        if h.kind is Kind.CONTRIBUTION and not h.flags & Flags.RETRANSMIT:
            note_sequence(job, h.rank, h.serial, cells, out)
        elif h.kind is Kind.QUERY and h.flags & Flags.SENT and received == 1:
            note_sent(job, h.rank, self._pool.views[index][HEADER_SIZE], cells, out)
            received = 0  # the number was the query's whole payload
        if job.diverged is not None:
            cells[Counter.DROP_MISMATCH] += 1
            cells[Counter.JOB_NOTICES] += 1
            out.append(self._notice(Kind.DIVERGED, h, source, job.diverged.encode()))
            return False
        if job.fence is not None and fenced_out(job, h.round, now, cells):
            return False
        if h.slot >= spec.slots:
            cells[Counter.DROP_BAD_SLOT] += 1
            return False
        query = h.kind is Kind.QUERY
        length = h.length if query else received  # a query names the segment's length
        if ((query and received) or (not query and received != h.length) or length == 0
                or length % ITEMSIZE[h.dtype] or length > self._arena.max_payload):
            cells[Counter.DROP_BAD_LENGTH] += 1
            return False
        job.last_activity = now
        job.last_data[h.rank] = now

        slot = job.slots[h.slot]
        latest = slot.copies[slot.latest]
        other = slot.copies[1 - slot.latest]
        if h.use == latest.use and latest.state is not CopyState.EMPTY:
            copy = latest
        elif h.use == other.use and other.state is not CopyState.EMPTY:
            copy = other
        elif h.use == next_number(latest.use):
            if query:  # asks after a use that never started here: "send it again"
                cells[Counter.PENDING_SENT] += 1
                out.append(self._notice(Kind.PENDING, h, source, bytes((spec.world_size + 7) // 8)))
                return False
            return self._start_use(job, slot, h, index, now, out)
        elif number_before(h.use, latest.use):
            cells[Counter.DROP_STALE] += 1
            return False
        else:  # a use beyond the next: no rank may be there yet
            cells[Counter.DROP_WINDOW] += 1
            return False

        if (copy.round != h.round or copy.offset != h.offset or copy.length != length
                or copy.dtype is not h.dtype or copy.op is not h.op):
            cells[Counter.DROP_MISMATCH] += 1
            self._diverge(job, copy, h, out)
            return False
        if copy.state is CopyState.COMPLETE:
            if query and on_its_way(copy, h, now - copy.finished):
                # A worker asks after a result that is most likely queued on its way. A whole
                # copy would only add a duplicate to the queue. It hears "every rank is in";
                # its next timer falls later. A worker that has a later result lost this one:
                # resent.
                cells[Counter.RESULTS_WITHHELD] += 1
                self._waiting(job, copy, h, source, out)
                return False
            cells[Counter.RESULTS_RESENT] += 1
            if lost_on_the_way(copy, h):
                job.lost_to[h.rank] += 1
            out.append(Send(source, resent(copy.header), copy.result))
            return False
        if query or copy.arrived >> h.rank & 1:
            cells[Counter.DUPLICATES if not query else Counter.QUERIES] += 1
            if query or h.flags & Flags.RETRANSMIT:
                self._waiting(job, copy, h, source, out)
            return False
        return self._accumulate(job, copy, h.rank, index, now, out, echoed(h.flags))

    def _member(self, h: Header, source: Address, out: list[Send]) -> JobState | None:
        """The job `h` is from, when it comes from a rank bound there (its cookie, its rank,
        the endpoint that rank joined from); else None, counted by reason. A bound endpoint of
        a job aborted meanwhile is told so."""
        cells = self._cells
        job = self._jobs.get(h.job_id)
        if job is None:
            tomb = self._aborted.get(h.job_id)
            if tomb is not None and tomb[0] == h.cookie and source in tomb[1]:
                cells[Counter.ABORT_NOTICES] += 1
                out.append(self._notice(Kind.ABORTED, h, source, tomb[2]))
            else:
                cells[Counter.DROP_UNKNOWN_JOB] += 1
            return None
        spec = job.spec
        if h.cookie != spec.cookie:
            cells[Counter.DROP_BAD_COOKIE] += 1
        elif h.rank >= spec.world_size:
            cells[Counter.DROP_BAD_RANK] += 1
        elif spec.endpoints[h.rank] != source:
            cells[Counter.DROP_BAD_SOURCE] += 1
            if spec.endpoints[h.rank] is not None:  # its own cookie, from elsewhere: a NAT?
                job.elsewhere[h.rank] = source
        else:
            return job
        return None

    def _diverge(self, job: JobState, copy: SlotCopy, h: Header, out: list[Send]) -> None:
        """The ranks disagree on what one use of a slot is: tell every rank why, now and on
        every later datagram of this epoch, instead of letting them wait for each other."""
        job.diverged = divergence(job, copy, h)
        out.extend(self._tell(job, Kind.DIVERGED, job.diverged.encode()))

    def _start_use(self, job: JobState, slot: Slot, h: Header, index: int, now: float,
                   out: list[Send]) -> bool:
        latest = slot.copies[slot.latest]
        if latest.state is CopyState.FILLING:
            if h.round == latest.round:
                # Workers never start a slot's next segment before its previous result: a
                # peer out of protocol. Dropping keeps the filling segment intact.
                self._cells[Counter.DROP_SLOT_BUSY] += 1
                return False
            self._cells[Counter.ABANDONED] += 1
            job.release_held(latest, self._pool)
        slot.latest = 1 - slot.latest
        copy = slot.copies[slot.latest]
        job.release_held(copy, self._pool)
        copy.begin(h.use, h.round, h.offset, h.dtype, h.op, self._kernels.kernel(h.dtype, h.op),
                   h.length, now)
        return self._accumulate(job, copy, h.rank, index, now, out, echoed(h.flags))

    def _accumulate(self, job: JobState, copy: SlotCopy, rank: int, index: int, now: float,
                    out: list[Send], echo: int = 0) -> bool:
        """Fold the payload in buffer `index` in; True when the buffer is kept (held).
        `echo`: the flags its RESULT carries if it completes the copy (`echoed`)."""
        kernel = copy.kernel
        assert kernel is not None
        acc = copy.acc_n
        n = len(acc)
        elements = self._pool.elements[ITEMSIZE[copy.dtype]]
        held = False
        if job.spec.deterministic and rank != copy.next_rank:
            # Out of turn: keep the datagram's buffer until the ranks before it are summed,
            # within the job's quota and never the pool's last buffers (the transport needs
            # some to receive into).
            if job.held >= job.spec.hold_buffers or self._pool.free < self._reserve:
                self._cells[Counter.DROP_NO_BUFFER] += 1
                return False  # not marked arrived: the worker's retransmission will bring it
            copy.held[rank] = index
            job.held += 1
            held = True
        else:
            payload = elements[index]
            if len(payload) != n:
                payload = payload[:n]
            if copy.count == 0 or (job.spec.deterministic and rank == 0):
                kernel.first(acc, payload)
            else:
                kernel.add(acc, payload)
            if job.spec.deterministic:
                copy.next_rank = rank + 1
                while copy.next_rank in copy.held:
                    waiting = copy.held.pop(copy.next_rank)
                    kernel.add(acc, elements[waiting][:n])
                    self._pool.release(waiting)
                    job.held -= 1
                    copy.next_rank += 1
        copy.arrived |= 1 << rank
        copy.count += 1
        if copy.count < job.spec.world_size:
            copy.state = move(copy.state, Event.ADD)
            return held
        copy.finished = now
        self._finish(job, copy, kernel, acc, out, rank, echo, None)
        return held

    def _finish(self, job: JobState, copy: SlotCopy, kernel: SegmentKernel,
                acc: NDArray[np.float32], out: list[Send], completer: int,
                echo: int, result: NDArray[np.uint8] | None) -> None:
        """The contribution of rank `completer` made `copy` whole: send its result (the
        header names `completer` and carries the flags `echo`: `echoed`, see wire.py).
        `result`: its bytes, when the burst path finished several copies at once."""
        spec = job.spec
        if result is None:
            result = kernel.finish(acc, spec.world_size, copy.out)
        copy.result = memoryview(result)  # type: ignore[arg-type]
        copy.state = move(copy.state, Event.LAST)
        # wire.pack_into's layout, without building a Header: this runs once per segment.
        # Into the arena right before the result (fp32: the accumulator; fp16/bf16: the
        # narrowed buffer), so that header and payload are one contiguous message.
        copy.header = copy.heads[copy.dtype is not DType.FLOAT32]
        HEADER.pack_into(copy.header, 0, MAGIC, VERSION, Kind.RESULT, copy.dtype, copy.op, echo,
                         spec.job_id, completer, spec.epoch, spec.cookie, copy.round, copy.slot,
                         copy.offset, copy.length, copy.use)
        copy.serial = copy.header[SERIAL_AT] = job.serial
        job.serial = (job.serial + 1) % SERIALS
        self._cells[Counter.SEGMENTS_REDUCED] += 1
        self._cells[Counter.BYTES_REDUCED] += copy.length
        job.segments_reduced += 1
        job.bytes_reduced += copy.length
        if not job.rounds or number_before(job.rounds, copy.round):  # (0: none yet)
            job.rounds = copy.round
        if spec.multicast is not None:
            out.append(Send(spec.multicast, copy.header, copy.result))
        else:
            out.extend(Send(a, copy.header, copy.result) for a in job.bound)

    def _waiting(self, job: JobState, copy: SlotCopy, h: Header, source: Address,
                 out: list[Send]) -> None:
        sends = pending_notes(job, copy, h, source)
        self._cells[Counter.PENDING_SENT] += len(sends)
        out.extend(sends)

    def _tell(self, job: JobState, kind: Kind, payload: bytes,
              counter: Counter = Counter.JOB_NOTICES) -> list[Send]:
        notices = to_every_rank(job, kind, payload)
        self._cells[counter] += len(notices)
        return notices

    def _notice(self, kind: Kind, h: Header, dest: Address, payload: bytes = b"") -> Send:
        """A notice answering `h`; it carries the job's current epoch when the job exists."""
        job = self._jobs.get(h.job_id)
        return answer(kind, h, dest, job.spec.epoch if job is not None else h.epoch, payload)

