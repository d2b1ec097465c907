"""A coalesced receive taken as one unit: the aggregator's burst path.

UDP GRO hands a core up to 64 KB of consecutive datagrams from one source at a time, and on a
busy rack almost every such receive is a run of one rank's contributions to consecutive slots
(a worker sends a window's consecutive segments to a core in one GSO send). One at a time,
each would cost a copy into a receive buffer, a decoded `Header`, the job and member checks,
the window checks and its own kernel call, several microseconds of Python in all. Here a run
pays for one decoded header and one set of job checks; every other datagram is compared with
the first as bytes and only its slot, offset and use are read; and when the slots' copies lie
at a fixed stride in the arena (they do: a job's slots are allocated consecutively and their
copies alternate in step), one kernel call folds the whole run in, straight from the
transport's buffer.

The path is all or nothing, and it changes nothing until it has said yes: a run with anything
unusual in it (a retransmission, a query, a duplicate, a stranger, a deterministic job, a slot
busy with another round, a shorter datagram) is declined, and the aggregator then takes its
datagrams one by one, every check on the way. A run taken here leaves the aggregator exactly
as the one-by-one path would have: the same sends, counters, slot states and results
(tests/unit/test_runs.py holds them side by side, on hypothesis-generated mixed runs).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from .counters import Counter, Counters
from .reduce import STORAGE, KernelTable, SegmentKernel
from .slots import SlotArena
from .slotstate import CopyState, Event, JobState, SlotCopy, move
from .spec import Address
from .transport import Send, Staging, datagram_starts
from .wire import HEADER, HEADER_SIZE, ITEMSIZE, MAGIC, SERIAL_AT, VERSION, DType, Kind, Op

__all__ = ["RunPath"]

# What differs between the datagrams of a run: slot, offset, length, use (HEADER's last four).
_TAIL = struct.Struct("!IQII")
_TAIL_AT = HEADER_SIZE - _TAIL.size
_DTYPES = {int(d): d for d in DType}
_OPS = {int(o): o for o in Op}
_FILLING = CopyState.FILLING

#: finish(job, copy, kernel, acc, out): the aggregator's own, for a copy every rank is in
Finish = Callable[[JobState, SlotCopy, SegmentKernel, NDArray[np.float32], list[Send]], None]
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
        possibly shorter, from `source`), and append what to send."""
        if not self._whole(staging, nbytes, size, source, now, out):
            self._cells[Counter.RUNS_DECLINED] += 1
            self._one_by_one(staging, nbytes, size, source, now, out)

    def _one_by_one(self, staging: Staging, nbytes: int, size: int, source: Address,
                    now: float, out: list[Send]) -> None:
        """A run declined: each datagram copied into a receive buffer and handed to `one`.
        (One buffer at a time: only deterministic jobs keep any, and never the pool's last.)"""
        pool, data, cells = self._pool, staging.view, self._cells
        for start in datagram_starts(nbytes, size):
            length = min(size, nbytes - start)
            index = pool.take()
            if index is None:
                cells[Counter.DROP_NO_BUFFER] += 1
                continue
            if length > len(pool.views[index]):  # longer than any datagram we would send
                pool.release(index)
                cells[Counter.DROP_TRUNCATED] += 1
                continue
            pool.views[index][:length] = data[start:start + length]
            self._one(index, length, source, now, out)

    def _whole(self, staging: Staging, nbytes: int, size: int, source: Address, now: float,
               out: list[Send]) -> bool:
        """Fold in the run whole and append what to send; False, with nothing changed, when
        anything in it needs the one-by-one path."""
        count, rest = divmod(nbytes, size) if size > HEADER_SIZE else (0, 1)
        if rest or count < 1:
            return False
        buf = staging.buffer
        (magic, version, kind, dtype_no, op_no, flags, job_id, rank, epoch, cookie, round_no,
         first_slot, _, length, _) = HEADER.unpack_from(buf)
        # Only first transmissions of contributions (flags 0; a contribution carries serial 0).
        if (magic != MAGIC or version != VERSION or kind != Kind.CONTRIBUTION or flags
                or buf[SERIAL_AT] or length != size - HEADER_SIZE):
            return False
        job = self._jobs.get(job_id)
        if job is None:
            return False
        spec = job.spec
        dtype, op = _DTYPES.get(dtype_no), _OPS.get(op_no)
        if (dtype is None or op is None or cookie != spec.cookie or rank >= spec.world_size
                or spec.endpoints[rank] != source or epoch != spec.epoch
                or job.diverged is not None or spec.deterministic
                or first_slot + count > spec.slots or length % ITEMSIZE[dtype]
                or length > self._arena.max_payload):
            return False
        # The others: the same header but for slot, offset and use; the next slot each.
        same = buf[:_TAIL_AT]
        unpack_tail = _TAIL.unpack_from
        tails = [unpack_tail(buf, _TAIL_AT)]
        for at in range(size, nbytes, size):
            if buf[at:at + _TAIL_AT] != same:
                return False
            tail = unpack_tail(buf, at + _TAIL_AT)
            if tail[0] != first_slot + len(tails):
                return False
            tails.append(tail)
        # Where each lands: the copy filling that use (this rank not in yet, the same segment
        # named alike), or the slot's next use over a finished or empty copy.
        bit = 1 << rank
        slots = job.slots
        plan: list[tuple[SlotCopy, bool]] = []  # (copy, its next use starts here)
        for slot_no, offset, _, use in tails:
            slot = slots[slot_no]
            latest = slot.copies[slot.latest]
            if latest.state is _FILLING:
                if (use != latest.use or latest.arrived & bit or latest.round != round_no
                        or latest.offset != offset or latest.length != length
                        or latest.dtype is not dtype or latest.op is not op):
                    return False
                plan.append((latest, False))
            elif use == latest.use + 1:
                plan.append((slot.copies[1 - slot.latest], True))
            else:
                return False

        # Yes: from here on, exactly what the one-by-one path does for each datagram.
        self._cells[Counter.RUNS_TAKEN] += 1
        job.last_seen[rank] = now
        job.last_activity = now
        job.last_data[rank] = now
        kernel = self._kernels.kernel(dtype, op)
        for (copy, starts), (slot_no, offset, _, use) in zip(plan, tails, strict=True):
            if starts:
                slot = slots[slot_no]
                slot.latest = 1 - slot.latest
                copy.begin(use, round_no, offset, dtype, op, kernel, length, now)
        self._fold(job, plan, staging, size, count, kernel)
        world = spec.world_size
        for copy, _ in plan:
            copy.arrived |= bit
            copy.count += 1
            if copy.count < world:
                copy.state = move(copy.state, Event.ADD)
            else:
                copy.finished = now
                self._finish(job, copy, kernel, copy.acc_n, out)
        return True

    def _fold(self, job: JobState, plan: list[tuple[SlotCopy, bool]], staging: Staging,
              size: int, count: int, kernel: SegmentKernel) -> None:
        """Fold each datagram's payload into its copy: one kernel call for the whole run when
        its copies are the rows of one arena view and all of them start (or all go on)."""
        first_copy = plan[0][0]
        payloads = staging.rows(size, STORAGE[first_copy.dtype])
        starting = first_copy.count == 0
        which = first_copy.copy
        base = job.arena_first
        if base >= 0 and all(copy.copy == which and (copy.count == 0) is starting
                             for copy, _ in plan):
            rows = self._arena.accumulator_rows(base + first_copy.slot, count, which)
            rows = rows[:, :len(first_copy.acc_n)]
            if starting:
                kernel.first_rows(rows, payloads[:count])
            else:
                kernel.add_rows(rows, payloads[:count])
            return
        for i, (copy, _) in enumerate(plan):
            if copy.count == 0:
                kernel.first(copy.acc_n, payloads[i])
            else:
                kernel.add(copy.acc_n, payloads[i])
