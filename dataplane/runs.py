"""A coalesced receive taken in bursts: the aggregator's burst path.

UDP GRO hands a core up to 64 KB of consecutive datagrams from one source at a time, and on a
busy rack almost every such receive is a run of one rank's contributions to consecutive slots
(a worker sends a window's consecutive segments to a core in one GSO send). One at a time,
each would cost a copy into a receive buffer, a decoded `Header`, the job and member checks,
the window checks and its own kernel call, several microseconds of Python in all. Here a burst
pays for one decoded header and one set of job checks; every other datagram is compared with
the first as bytes and only its sequence (dataplane.gaps), slot, offset and use are read; and
where the slots' copies lie at a fixed stride in the arena (they do: a job's slots are
allocated consecutively and their copies alternate in step), one kernel call folds a stretch
of consecutive slots in, straight from the transport's buffer. The last rank's burst makes such
a stretch whole, and a 16-bit stretch's results are narrowed from fp32 with one cast as well.

A burst changes nothing until it has said yes. It runs from its first datagram up to the first
that needs the one-by-one path: a retransmission, a query, a duplicate, a stranger, a
deterministic job, a slot busy with another round, a slot named twice, a shorter datagram.
That datagram is taken alone, every check on the way, and the next burst starts after it, so
under loss (where retransmissions and queries land among the contributions, and a window's
releases come out of slot order) the rest of a receive still goes as bursts. The slots of a
burst need not be consecutive; each stretch of consecutive ones is folded with one kernel call.
A receive taken so leaves the aggregator exactly as the one-by-one path would have: the same
sends, counters, slot states and results (tests/unit/test_runs.py holds them side by side, on
hypothesis-generated mixed runs).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .counters import Counter, Counters
from .gaps import note_sequence
from .reduce import STORAGE, KernelTable, SegmentKernel
from .slots import SlotArena
from .slotstate import CopyState, Event, JobState, SlotCopy, move
from .spec import Address
from .transport import Send, Staging
from .wire import (
    HEADER,
    HEADER_SIZE,
    ITEMSIZE,
    MAGIC,
    SERIAL_AT,
    SERIALS,
    VERSION,
    WRAP,
    DType,
    Flags,
    Kind,
    Op,
)

__all__ = ["RunPath"]

# What differs between the datagrams of a run: slot, offset, length, use (HEADER's last four).
_TAIL = struct.Struct("!IQII")
_TAIL_AT = HEADER_SIZE - _TAIL.size
_DTYPES = {int(d): d for d in DType}
_OPS = {int(o): o for o in Op}
_FILLING = CopyState.FILLING
# every bit but those a first transmission may carry, known or not (as a plain int: an
# IntFlag's complement keeps only the defined bits, and a stray bit would pass)
_NOT_FIRST = ~int(Flags.QUEUED | Flags.REPAIRED)

#: finish(job, copy, kernel, acc, out, completer, echo, result): the aggregator's own, for a
#: copy every rank is in (`completer` the rank whose contribution made it whole, `echo` the
#: flags its RESULT carries: here that contribution's QUEUED and REPAIRED, since a run holds
#: first transmissions only; `result` its result bytes when already finished, else None)
Finish = Callable[[JobState, SlotCopy, SegmentKernel, NDArray[np.float32], list[Send], int,
                   int, NDArray[np.uint8] | None], None]
#: one(index, nbytes, source, now, out): the aggregator's one-by-one path, for a datagram in
#: receive-pool buffer `index`
One = Callable[[int, int, Address, float, list[Send]], None]


class RunPath:
    """Takes runs for an aggregator, over its jobs, arena, kernels and counters: whole, or
    through its one-by-one path (`one`: a datagram in a receive-pool buffer)."""

    def __init__(self, jobs: dict[int, JobState], arena: SlotArena, kernels: KernelTable,
                 counters: Counters, finish: Finish, one: One) -> None:
        self._jobs = jobs
        self._arena = arena
        self._pool = arena.rx
        self._kernels = kernels
        self._cells = counters.cells
        self._finish = finish
        self._one = one

    def take(self, staging: Staging, nbytes: int, size: int, source: Address, now: float,
             out: list[Send]) -> None:
        """Take in the run of `nbytes` in `staging` (datagrams of `size` bytes, the last
        possibly shorter, from `source`), and append what to send: as bursts where it can,
        each datagram that breaks a burst one by one, in the order they came."""
        at = 0
        burst, cells = self._burst, self._cells
        while at < nbytes:
            taken = burst(staging, at, nbytes, size, source, now, out)
            if taken:
                at += taken * size
                continue
            end = at + size if at + size < nbytes else nbytes
            cells[Counter.DECLINED_DATAGRAMS] += 1
            self._alone(staging, at, end, source, now, out)
            at = end

    def _alone(self, staging: Staging, start: int, end: int, source: Address, now: float,
               out: list[Send]) -> None:
        """One datagram the burst path declined, copied into a receive buffer and handed to
        `one`. (One buffer at a time: only deterministic jobs keep any, and never the pool's
        last.)"""
        pool, cells = self._pool, self._cells
        index = pool.take()
        if index is None:
            cells[Counter.DROP_NO_BUFFER] += 1
            return
        length = end - start
        if length > len(pool.views[index]):  # longer than any datagram we would send
            pool.release(index)
            cells[Counter.DROP_TRUNCATED] += 1
            return
        pool.views[index][:length] = staging.view[start:end]
        self._one(index, length, source, now, out)

    def _burst(self, staging: Staging, start: int, nbytes: int, size: int, source: Address,
               now: float, out: list[Send]) -> int:
        """Fold in the burst that begins at byte `start`: the datagrams from there up to the
        first that needs the one-by-one path (the whole rest when none does); append what to
        send and return how many it took, 0 (nothing changed) when the first needs it."""
        if size <= HEADER_SIZE or start + size > nbytes:
            return 0  # a shorter last datagram
        buf = staging.buffer
        (magic, version, kind, dtype_no, op_no, flags, job_id, rank, epoch, cookie, round_no,
         _, _, length, _) = HEADER.unpack_from(buf, start)
        # Only first transmissions of contributions (no flags but QUEUED and REPAIRED, the
        # same on every datagram of the run: the header tails compared below include them;
        # a RESULT echoes both).
        if (magic != MAGIC or version != VERSION or kind != Kind.CONTRIBUTION
                or flags & _NOT_FIRST or length != size - HEADER_SIZE):
            return 0
        job = self._jobs.get(job_id)
        if job is None:
            return 0
        spec = job.spec
        dtype, op = _DTYPES.get(dtype_no), _OPS.get(op_no)
        if (dtype is None or op is None or cookie != spec.cookie or rank >= spec.world_size
                or spec.endpoints[rank] != source or epoch != spec.epoch
                or job.diverged is not None or job.fence is not None or spec.deterministic
                or length % ITEMSIZE[dtype]
                or length > self._arena.max_payload):
            return 0
        # Each datagram: the same header as the first but for its sequence (the `serial`
        # byte), slot, offset and use, a slot of the job's that none before it in the burst
        # named (each is planned against the state before the burst), and a place to land:
        # the copy filling that use (this rank not in yet, the same segment named alike), or
        # the slot's next use over a finished or empty copy. The burst ends before the first
        # that is not so. (`same` takes each datagram's sequence before the comparison: one
        # slice compared, not two.)
        same = buf[start:start + _TAIL_AT]
        unpack_tail = _TAIL.unpack_from
        bit = 1 << rank
        slots, slot_count = job.slots, spec.slots
        named = 0  # the burst's slots, as bits
        # (copy, does its use start here, slot, offset, use, sequence)
        plan: list[tuple[SlotCopy, bool, int, int, int, int]] = []
        for at in range(start, nbytes - size + 1, size):
            same[SERIAL_AT] = sequence = buf[at + SERIAL_AT]
            if buf[at:at + _TAIL_AT] != same:
                break
            slot_no, offset, _, use = unpack_tail(buf, at + _TAIL_AT)
            if slot_no >= slot_count or named >> slot_no & 1:
                break
            slot = slots[slot_no]
            latest = slot.copies[slot.latest]
            if latest.state is _FILLING:
                if (use != latest.use or latest.arrived & bit or latest.round != round_no
                        or latest.offset != offset or latest.length != length
                        or latest.dtype is not dtype or latest.op is not op):
                    break
                plan.append((latest, False, slot_no, offset, use, sequence))
            elif use == latest.use % WRAP + 1:  # wire.next_number, in line
                plan.append((slot.copies[1 - slot.latest], True, slot_no, offset, use, sequence))
            else:
                break
            named |= 1 << slot_no
        if not plan:
            return 0

        # Yes: from here on, exactly what the one-by-one path does for each datagram.
        self._cells[Counter.RUNS_TAKEN] += 1
        job.last_seen[rank] = now
        job.last_activity = now
        job.last_data[rank] = now
        kernel = self._kernels.kernel(dtype, op)
        for copy, starts, slot_no, offset, use, _ in plan:
            if starts:
                slot = slots[slot_no]
                slot.latest = 1 - slot.latest
                copy.begin(use, round_no, offset, dtype, op, kernel, length, now)
        self._fold(job, plan, staging.rows(size, STORAGE[dtype])[start // size:], kernel)
        world = spec.world_size
        narrows, finished = kernel.narrows, None
        cells = self._cells
        numbers = job.next_sequence
        expected = numbers[rank]
        for copy, _, _, _, _, sequence in plan:
            if sequence == expected:  # in order (nearly always): `note_sequence` in line
                expected = numbers[rank] = (sequence + 1) % SERIALS
            else:
                note_sequence(job, rank, sequence, cells, out)
                expected = numbers[rank]
            copy.arrived |= bit
            copy.count += 1
            if copy.count < world:
                copy.state = move(copy.state, Event.ADD)
            else:
                copy.finished = now
                if narrows and finished is None:  # the burst's first copy made whole
                    finished = self._finish_ahead(job, plan, copy, kernel, bit)
                self._finish(job, copy, kernel, copy.acc_n, out, rank, flags,
                             finished.get(copy) if finished else None)
        return len(plan)

    def _finish_ahead(self, job: JobState, plan: list[tuple[SlotCopy, bool, int, int, int, int]],
                      whole: SlotCopy, kernel: SegmentKernel,
                      bit: int) -> dict[SlotCopy, NDArray[np.uint8]]:
        """Finish, a stretch at a time, the copies this burst makes whole from `whole` on
        (just made whole; a later one when every other rank is in): each stretch of two or
        more (consecutive slots, the same copy of each, as in `_fold`) with one `finish_rows`,
        before the burst goes on to them. Their results, by copy; the others are finished one
        by one, as before. (Called at the burst's first copy made whole: a burst that makes
        none whole pays nothing, nor does the loop over the burst look up an index.)"""
        base, count = job.arena_first, len(plan)
        finished: dict[SlotCopy, NDArray[np.uint8]] = {}
        if base < 0:
            return finished
        others = job.all_ranks & ~bit  # a copy is made whole here when these are all in
        start = next(i for i, entry in enumerate(plan) if entry[0] is whole)
        i = start
        while i < count:
            copy = plan[i][0]
            if i > start and copy.arrived != others:
                i += 1
                continue
            j = i + 1
            while (j < count and plan[j][0].slot == copy.slot + (j - i)
                   and plan[j][0].copy == copy.copy and plan[j][0].arrived == others):
                j += 1
            if j - i > 1:
                first, n = base + plan[i][2], len(copy.acc_n)
                acc = self._arena.accumulator_rows(first, j - i, copy.copy)[:, :n]
                out = self._arena.result_rows(first, j - i, copy.copy)
                results = kernel.finish_rows(acc, job.spec.world_size, out)
                finished.update(zip((entry[0] for entry in plan[i:j]), results, strict=True))
            i = j
        return finished

    def _fold(self, job: JobState, plan: list[tuple[SlotCopy, bool, int, int, int, int]],
              payloads: NDArray[Any], kernel: SegmentKernel) -> None:
        """Fold each datagram's payload (`payloads`' rows, in order) into its copy: one kernel
        call for each stretch of the burst whose copies are the rows of one arena view
        (consecutive slots, the same copy of each, all starting or all going on)."""
        base, count = job.arena_first, len(plan)
        i = 0
        while i < count:
            copy = plan[i][0]
            starting = copy.count == 0
            j = i + 1
            if base >= 0:
                while (j < count and plan[j][0].slot == copy.slot + (j - i)
                       and plan[j][0].copy == copy.copy and (plan[j][0].count == 0) is starting):
                    j += 1
            if j - i == 1:
                if starting:
                    kernel.first(copy.acc_n, payloads[i])
                else:
                    kernel.add(copy.acc_n, payloads[i])
            else:
                rows = self._arena.accumulator_rows(base + plan[i][2], j - i, copy.copy)
                rows = rows[:, :len(copy.acc_n)]
                if starting:
                    kernel.first_rows(rows, payloads[i:j])
                else:
                    kernel.add_rows(rows, payloads[i:j])
            i = j
