"""Burst decoding: the headers of a whole receive batch at once, cut into runs.

A core receives its contributions in bursts (UDP GRO hands over up to 64 datagrams of one flow
per call; a RoCE completion queue is polled in batches). Decoding each 48-byte header with
`wire.unpack` costs about a microsecond of Python per datagram, as much as reducing its 8.9 KB
payload. Here numpy decodes every header of a batch in a handful of vectorised operations, and
cuts the batch into *runs*: maximal stretches of consecutive, well-formed contributions of one
rank to one job and round, in consecutive slots at consecutive offsets (what a worker's window
of segments looks like). The aggregator then checks a run's job once and reduces the run's
payloads with one kernel call where its accumulators lie at a constant stride.

Anything else (a QUERY, a heartbeat, a retransmission, a malformed header, a payload whose
length disagrees with its header) is a run of one datagram marked `fast = False`, and the
aggregator takes it the careful way, one datagram at a time, with `wire.unpack` and every
check. Nothing here decides anything: it only describes the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
from numpy.typing import NDArray

from .counters import Counter, Counters
from .reduce import KernelTable, SegmentKernel
from .slots import SlotArena
from .slotstate import CopyState, Event, JobState, SlotCopy, move
from .spec import Address
from .transport import RxBatch, Send
from .wire import HEADER, HEADER_SIZE, ITEMSIZE, MAGIC, VERSION, DType, Flags, Kind, Op

__all__ = ["BurstPath", "Runs", "decode_runs"]

_DTYPES = {int(d): d for d in DType}
_OPS = {int(o): o for o in Op}

# The header as six 64-bit words once byte-swapped to host order (the wire is big-endian):
#   0: magic | version | kind | dtype | op | flags | 0     3: round | slot
#   1: job id | rank | epoch                               4: offset
#   2: cookie                                              5: length | use
# The next segment of a run differs from its predecessor only in word 3 (slot + 1) and word
# 4 (offset + length), so one subtraction of consecutive rows tells runs apart. A slot that
# wraps into the round would pass for a successor; its slot then lies outside every job and
# the careful path refuses it.
_WORDS = HEADER_SIZE // 8
assert HEADER.format == "!HBBBBBxIHHQIIQII" and _WORDS == 6
_FAST_MASK = 0xFFFF_FFFF_0000_FF00  # magic, version, kind, flags
_FAST_WORD = MAGIC << 48 | VERSION << 40 | Kind.CONTRIBUTION << 32 | Flags.NONE << 8
_HALF = 32
_LOW32 = 0xFFFF_FFFF
# numpy scalars made once: converting a Python int costs as much as a small array operation
_U_HALF, _U_ONE, _U_HEADER = np.uint64(_HALF), np.uint64(1), np.uint64(HEADER_SIZE)
_U_FAST_MASK, _U_FAST_WORD = np.uint64(_FAST_MASK), np.uint64(_FAST_WORD)


class Runs(NamedTuple):
    """A batch cut into runs, as parallel lists (one entry per run). A fast run's datagrams
    are batch entries `start .. start + size - 1`, with slot `slot + j` and offset
    `offset + j * length`; every other field is the same along the run. A slow run is one
    datagram, and its fields are meaningless."""

    start: list[int]
    size: list[int]
    fast: list[bool]
    job_id: list[int]
    rank: list[int]
    cookie: list[int]
    epoch: list[int]
    round: list[int]
    slot: list[int]
    offset: list[int]
    length: list[int]
    use: list[int]
    dtype: list[int]
    op: list[int]


def decode_runs(headers: NDArray[np.uint8], nbytes: NDArray[np.uint64]) -> Runs:
    """Describe a batch: `headers[i]` holds the first 48 bytes of datagram i as received
    (C-contiguous rows), `nbytes[i]` its whole length (a datagram shorter than a header is
    never fast, whatever its 48 bytes hold). About 20 numpy calls, whatever the batch size."""
    words = headers.view(np.uint64).byteswap()
    length = words[:, 5] >> _U_HALF
    fast = (words[:, 0] & _U_FAST_MASK) == _U_FAST_WORD
    fast &= length + _U_HEADER == nbytes
    fast &= nbytes > _U_HEADER
    step = words[1:] - words[:-1]  # wraps modulo 2**64: only equality matters
    step[:, 3] -= _U_ONE
    step[:, 4] -= length[:-1]
    joins = step.any(axis=1)  # True where datagram i + 1 does not extend datagram i
    joins |= ~fast[1:]
    joins |= ~fast[:-1]
    starts = [0, *(np.flatnonzero(joins) + 1).tolist()]
    sizes = [b - a for a, b in itertools.pairwise(starts)]
    sizes.append(len(words) - starts[-1])
    runs = Runs(starts, sizes, fast[starts].tolist(), [], [], [], [], [], [], [], [], [], [],
                [])
    for w0, w1, w2, w3, w4, w5 in words[starts].tolist():
        runs.job_id.append(w1 >> _HALF)
        runs.rank.append(w1 >> 16 & 0xFFFF)
        runs.epoch.append(w1 & 0xFFFF)
        runs.cookie.append(w2)
        runs.round.append(w3 >> _HALF)
        runs.slot.append(w3 & _LOW32)
        runs.offset.append(w4)
        runs.length.append(w5 >> _HALF)
        runs.use.append(w5 & _LOW32)
        runs.dtype.append(w0 >> 24 & 0xFF)
        runs.op.append(w0 >> 16 & 0xFF)
    return runs


class OneByOne(Protocol):
    """The careful path: `one(index, nbytes, source, now, out)` takes a single datagram."""

    def __call__(self, index: int, nbytes: int, source: Address, now: float,
                 out: list[Send]) -> None: ...


class Finisher(Protocol):
    """`finish(job, copy, kernel, acc, out)`: a copy got its last contribution; send it."""

    def __call__(self, job: JobState, copy: SlotCopy, kernel: SegmentKernel,
                 acc: NDArray[np.float32], out: list[Send]) -> None: ...


# (copy, receive buffer) pairs waiting for one kernel call
_Pending = list[tuple[SlotCopy, int]]


class BurstPath:
    """Takes the fast runs of a batch for the aggregator (which owns every object it touches:
    jobs, arena, pool, counters). A contribution is taken here only when it is exactly the
    next thing its slot expects (the first contribution of the slot's next use, or one more
    rank's contribution to the use filling now) for a job that is not deterministic; anything
    else in a run goes to `one`, so the outcome is the careful path's, datagram for datagram,
    only cheaper. Kernel calls wait until the run ends (or a datagram must go the careful
    way): a run touches each slot once, so the order of its reductions does not matter."""

    def __init__(self, jobs: Mapping[int, JobState], kernels: KernelTable, arena: SlotArena,
                 counters: Counters, one: OneByOne, finish: Finisher) -> None:
        self._jobs = jobs
        self._kernels = kernels
        self._arena = arena
        self._pool = arena.rx
        self._cells = counters.cells
        self._one = one
        self._finish = finish

    def _admits(self, job: JobState | None, runs: Runs, r: int, source: Address,
                dtype: DType | None, op: Op | None) -> bool:
        """Is the run from a bound rank of a live, non-deterministic job, in the job's epoch,
        inside its slots, with a payload the arena holds? (Else the careful path counts why.)"""
        if job is None or dtype is None or op is None:
            return False
        spec = job.spec
        rank, length = runs.rank[r], runs.length[r]
        return (runs.cookie[r] == spec.cookie and rank < spec.world_size
                and spec.endpoints[rank] == source and runs.epoch[r] == spec.epoch
                and job.diverged is None and not spec.deterministic
                and runs.slot[r] + runs.size[r] <= spec.slots
                and length % ITEMSIZE[dtype] == 0 and length <= self._arena.max_payload)

    def take(self, runs: Runs, r: int, batch: RxBatch, now: float, out: list[Send]) -> None:
        """Take run `r` of `batch`; its results and notices are appended to `out`."""
        start, size = runs.start[r], runs.size[r]
        indices, sources, nbytes = batch.index, batch.source, batch.nbytes
        source = sources[start]
        job = self._jobs.get(runs.job_id[r])
        dtype, op = _DTYPES.get(runs.dtype[r]), _OPS.get(runs.op[r])
        if not self._admits(job, runs, r, source, dtype, op):
            for i in range(start, start + size):
                self._one(indices[i], nbytes[i], sources[i], now, out)
            return
        assert job is not None and dtype is not None and op is not None
        rank, use, rnd = runs.rank[r], runs.use[r], runs.round[r]
        length, offset, first_slot = runs.length[r], runs.offset[r], runs.slot[r]
        job.last_seen[rank] = job.last_data[rank] = now
        job.last_activity = now
        bit = 1 << rank
        world = job.spec.world_size
        kernel = self._kernels.kernel(dtype, op)
        elements = length // ITEMSIZE[dtype]
        slots = job.slots
        firsts: _Pending = []
        adds: _Pending = []
        finished: list[SlotCopy] = []
        for j in range(size):
            i = start + j
            slot = slots[first_slot + j]
            latest = slot.copies[slot.latest]
            src = sources[i]
            if job.diverged is not None or (src is not source and src != source):
                copy = None  # (the careful path diverged the job a datagram ago)
            elif latest.use == use:  # one more rank of the use filling now
                copy = latest if (
                    latest.state is CopyState.FILLING and not latest.arrived & bit
                    and latest.round == rnd and latest.offset == offset + j * length
                    and latest.length == length and latest.dtype is dtype
                    and latest.op is op) else None
                if copy is not None:
                    adds.append((copy, indices[i]))
            elif latest.use + 1 == use and latest.state is not CopyState.FILLING:
                other = slot.copies[1 - slot.latest]
                if other.use == use and other.state is not CopyState.EMPTY:
                    copy = None  # (cannot happen: the other copy holds an older use)
                else:  # the first rank of the slot's next use
                    slot.latest = 1 - slot.latest
                    copy = other
                    copy.use, copy.round, copy.offset = use, rnd, offset + j * length
                    copy.dtype, copy.op, copy.kernel, copy.length = dtype, op, kernel, length
                    copy.acc_n = copy.acc[:elements]
                    copy.arrived = copy.count = copy.next_rank = 0
                    copy.state = move(copy.state, Event.START)
                    copy.started = now
                    firsts.append((copy, indices[i]))
            else:
                copy = None
            if copy is None:  # not what the slot expects: the careful path says why
                self._reduce(job, kernel, elements, firsts, adds, finished, out)
                self._one(indices[i], nbytes[i], src, now, out)
                continue
            copy.arrived |= bit
            copy.count += 1
            if copy.count == world:
                finished.append(copy)
        self._reduce(job, kernel, elements, firsts, adds, finished, out)

    def _reduce(self, job: JobState, kernel: SegmentKernel, elements: int, firsts: _Pending,
                adds: _Pending, finished: list[SlotCopy], out: list[Send]) -> None:
        """Apply the kernel calls waiting, finish the copies they completed, free buffers."""
        pool, taken = self._pool, len(firsts) + len(adds)
        for pending, rows, one in ((firsts, kernel.first_rows, kernel.first),
                                   (adds, kernel.add_rows, kernel.add)):
            if not pending:
                continue
            stacked = self._stacked(pending, elements, kernel)
            if stacked is not None:
                rows(*stacked)
            else:
                payloads = pool.elements[ITEMSIZE[pending[0][0].dtype]]
                for copy, index in pending:
                    one(copy.acc_n, payloads[index][:elements])
            for _, index in pending:
                pool.release(index)
            pending.clear()
        for copy in finished:
            self._finish(job, copy, kernel, copy.acc_n, out)
        finished.clear()
        self._cells[Counter.BURST_CONTRIBUTIONS] += taken

    def _stacked(self, pending: _Pending, elements: int, kernel: SegmentKernel
                 ) -> tuple[NDArray[np.float32], NDArray[Any]] | None:
        """The accumulators and payloads of `pending` as two 2-D arrays (no copy), when
        they lie at constant strides: consecutive arena slots, same copy, consecutive
        receive buffers (either way: the pool hands buffers back in runs). Else None."""
        count = len(pending)
        if count < 2:
            return None
        first, last = pending[0], pending[-1]
        arena_slot, copy_index = first[0].arena_slot, first[0].index
        step = 1 if last[1] >= first[1] else -1
        for j, (copy, index) in enumerate(pending):
            if (copy.arena_slot != arena_slot + j or copy.index != copy_index
                    or index != first[1] + step * j):
                return None
        low = min(first[1], last[1])
        payload = self._pool.rows[ITEMSIZE[first[0].dtype]][low:low + count, :elements]
        acc = self._arena.accumulator_rows(arena_slot, count, copy_index)[:, :elements]
        return acc, payload if step == 1 else payload[::-1]
