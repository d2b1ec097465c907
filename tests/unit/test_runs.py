"""The burst path (dataplane.runs) against the one-by-one path, side by side.

Two aggregators with the same jobs take the same coalesced receives: one as runs in a staging
buffer (the burst path, declining to the one-by-one path where it must), the other datagram by
datagram in receive-pool buffers. After every run they must have sent the same bytes to the
same places and counted the same things, and in the end hold the same slot states."""

from __future__ import annotations

from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import Address, RxBatch, Send, Staging
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    WRAP,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
    unpack,
)

from .feeding import feed

KERNELS = select_kernels("numpy")
COOKIE = 0xFEED_F00D_0000_0001
GROUP = ("239.255.0.9", 7100)
SLOTS = 8
PAYLOAD = 64  # bytes per segment: 16 fp32 or 32 fp16 elements
WORLD = 3
# job id -> (deterministic, multicast, dtype)
JOBS = {5: (False, True, DType.FLOAT32), 6: (False, False, DType.FLOAT16),
        7: (True, True, DType.FLOAT32), 8: (False, True, DType.BFLOAT16)}
ELEMENTS = {DType.FLOAT32: np.dtype(np.float32), DType.FLOAT16: np.dtype(np.float16),
            DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16)}


def where(rank: int) -> Address:
    return (f"198.18.0.{10 + rank}", 9000 + rank)


def build() -> tuple[SlotArena, Aggregator]:
    arena = SlotArena(capacity=len(JOBS) * SLOTS, max_payload=PAYLOAD, rx_buffers=256)
    agg = Aggregator(arena, KERNELS, Counters())
    for job, (deterministic, multicast, _) in JOBS.items():
        agg.add_job(JobSpec(job, COOKIE, WORLD, SLOTS, deterministic,
                            GROUP if multicast else None, epoch=1,
                            endpoints=tuple(where(r) for r in range(WORLD)),
                            hold_buffers=2 * SLOTS if deterministic else 0), 0.0)
    return arena, agg


@pytest.fixture
def pair() -> Iterator[tuple[Aggregator, Aggregator]]:
    arena_a, a = build()
    arena_b, b = build()
    yield a, b
    arena_a.close()
    arena_b.close()


def contribution(job: int, rank: int, slot: int, use: int, *, round_no: int = 1,
                 kind: Kind = Kind.CONTRIBUTION, flags: int = 0, cookie: int = COOKIE,
                 length: int = PAYLOAD, value: float = 1.0, sequence: int = 0) -> bytes:
    dtype = JOBS[job][2] if job in JOBS else DType.FLOAT32
    h = Header(kind, dtype, Op.SUM, flags, job, rank, cookie, round_no, slot,
               (use * SLOTS + slot) * PAYLOAD, length, use, 1, sequence)
    buf = bytearray(HEADER_SIZE)
    pack_into(buf, h)
    if kind is Kind.QUERY:
        return bytes(buf)
    elements = ELEMENTS[dtype]
    payload = np.full(length // elements.itemsize, value, elements)
    return bytes(buf) + payload.tobytes()


def as_run(datagrams: list[bytes], source: Address) -> RxBatch:
    """The datagrams as one coalesced receive (they must be of one size, but the last)."""
    staging = Staging(65536)
    data = b"".join(datagrams)
    staging.buffer[:len(data)] = data
    batch = RxBatch()
    batch.add_run(staging, len(data), len(datagrams[0]), source)
    return batch


def sent(sends: list[Send]) -> list[tuple[Address, bytes, bytes]]:
    return [(s.dest, bytes(s.header), bytes(s.payload)) for s in sends]


_PATH_COUNTERS = {Counter.RUNS_TAKEN, Counter.DECLINED_DATAGRAMS}  # only the run side has them


def counters(agg: Aggregator) -> dict[Counter, int]:
    return {c: agg.counters[c] for c in Counter if c not in _PATH_COUNTERS}


def taken(agg: Aggregator) -> int:
    return agg.counters[Counter.RUNS_TAKEN]


def same_state(a: Aggregator, b: Aggregator) -> None:
    """Both tell the same story: their job stats, and the answer of every slot use to a
    query from every rank (a result, a PENDING bitmap, or a drop)."""
    assert [a.stats(job, 1e3) for job in a.job_ids] == [b.stats(job, 1e3) for job in b.job_ids]
    for job in JOBS:
        for rank in range(WORLD):
            for use in range(1, 4):
                for slot in range(SLOTS):
                    query = contribution(job, rank, slot, use, kind=Kind.QUERY)
                    take_both(a, b, [query], where(rank), now=1e3)


def take_both(a: Aggregator, b: Aggregator, datagrams: list[bytes], source: Address,
              now: float = 0.0) -> list[tuple[Address, bytes, bytes]]:
    """One coalesced receive into each: `a` as a run, `b` one datagram at a time."""
    got = sent(a.on_batch(as_run(datagrams, source), now))
    want = sent(feed(b, [(d, source) for d in datagrams], now))
    assert got == want
    assert counters(a) == counters(b)
    return got


def test_a_regular_run_is_taken_whole_with_one_fold(pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    for rank in range(WORLD):
        run = [contribution(5, rank, s, 1, value=rank + 1.0) for s in range(SLOTS)]
        out = take_both(a, b, run, where(rank))
        assert taken(a) == rank + 1  # the burst path took every one of them
    assert len(out) == SLOTS  # the last rank finished every slot: one result each
    for dest, header, payload in out:
        assert dest == GROUP
        assert unpack(header).rank == WORLD - 1  # named as the one that completed it
        assert np.all(np.frombuffer(payload, np.float32) == 6.0)


def test_a_run_with_any_other_flag_goes_alone(pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    for rank, flags in enumerate((Flags.QUEUED | Flags.RETRANSMIT, 64)):  # a flag, a stray bit
        run = [contribution(5, rank, s, 1, flags=flags) for s in range(SLOTS)]
        take_both(a, b, run, where(rank))
    assert taken(a) == 0


@pytest.mark.parametrize("mark", [Flags.QUEUED, Flags.REPAIRED])
@pytest.mark.parametrize("last_marked", [True, False])
def test_a_run_marked_is_taken_whole_and_its_mark_echoed_only_by_the_completer(
        pair: tuple[Aggregator, Aggregator], mark: Flags, last_marked: bool) -> None:
    """QUEUED (plugin/congestion.py) and REPAIRED (a rank that starts its round late: wire.py)
    keep a run on the burst path; the RESULTs carry the completing rank's mark, whatever the
    earlier ranks' said."""
    a, b = pair
    for rank in range(WORLD):
        marked = last_marked if rank == WORLD - 1 else not last_marked
        run = [contribution(5, rank, s, 1, flags=mark if marked else 0)
               for s in range(SLOTS)]
        out = take_both(a, b, run, where(rank))
        assert taken(a) == rank + 1
    assert len(out) == SLOTS
    for _, header, _ in out:
        h = unpack(header)
        assert h.rank == WORLD - 1 and bool(h.flags & mark) is last_marked
        assert h.flags & ~mark == 0


def test_fp16_runs_fold_row_by_row_and_match(pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    for rank in range(WORLD):
        out = take_both(a, b, [contribution(6, rank, s, 1, value=0.5) for s in range(4)],
                        where(rank))
    assert taken(a) == WORLD
    assert len(out) == 4 * WORLD  # unicast: one result per rank per slot
    assert all(np.all(np.frombuffer(p, np.float16) == 1.5) for _, _, p in out)


@pytest.mark.parametrize("job", [6, 8], ids=["fp16-unicast", "bf16-multicast"])
def test_a_burst_that_completes_consecutive_slots_narrows_them_at_once(
        pair: tuple[Aggregator, Aggregator], monkeypatch: pytest.MonkeyPatch, job: int) -> None:
    """The last rank's burst over slots 0-4 and 6-7 (5 not yet its turn) makes them whole:
    one narrowing for 0-4, one for 6-7, and the same results as one by one."""
    a, b = pair
    kernel = KERNELS.kernel(JOBS[job][2], Op.SUM)
    calls: list[int] = []
    finish_rows = kernel.finish_rows

    def counted(acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]) -> list[
            NDArray[np.uint8]]:
        calls.append(len(acc))
        return finish_rows(acc, count, out)

    monkeypatch.setattr(kernel, "finish_rows", counted)
    for rank in range(WORLD - 1):
        take_both(a, b, [contribution(job, rank, s, 1, value=0.5) for s in range(SLOTS)],
                  where(rank))
    last = [contribution(job, WORLD - 1, s, 1, value=0.25) for s in range(SLOTS) if s != 5]
    assert calls == []
    out = take_both(a, b, last, where(WORLD - 1))
    assert calls == [5, 2]  # `b` never takes a burst: these are `a`'s
    results = [np.frombuffer(p, ELEMENTS[JOBS[job][2]]).astype(np.float32) for _, _, p in out]
    assert len(results) == 7 * (1 if JOBS[job][1] else WORLD)
    assert all(np.all(r == 1.25) for r in results)


@pytest.mark.parametrize(("spoil", "alone", "bursts"), [
    ("retransmit", 1, 2), ("query", 4, 0), ("duplicate", 1, 1), ("stranger", 4, 0),
    ("cookie", 1, 1), ("deterministic", 4, 0), ("short", 1, 1), ("next-use-busy", 4, 0),
    ("round", 3, 1), ("slot-twice", 1, 2)])  # round: the job diverged
def test_what_needs_the_one_by_one_path_goes_alone_and_the_rest_as_bursts(
        pair: tuple[Aggregator, Aggregator], spoil: str, alone: int, bursts: int) -> None:
    a, b = pair
    job, source = (7 if spoil == "deterministic" else 5), where(1)
    take_both(a, b, [contribution(job, 0, s, 1) for s in range(4)], where(0))
    before = taken(a)
    run = [contribution(job, 1, s, 1) for s in range(4)]
    if spoil == "retransmit":
        run[2] = contribution(job, 1, 2, 1, flags=Flags.RETRANSMIT)
    elif spoil == "query":
        run = [contribution(job, 1, s, 1, kind=Kind.QUERY) for s in range(4)]
    elif spoil == "duplicate":
        take_both(a, b, run[:1], source)
        before = taken(a)
    elif spoil == "stranger":
        source = ("198.18.0.99", 9000)
    elif spoil == "cookie":
        run[3] = contribution(job, 1, 3, 1, cookie=COOKIE + 1)
    elif spoil == "short":
        run[3] = contribution(job, 1, 3, 1, length=PAYLOAD // 2)
    elif spoil == "next-use-busy":
        run = [contribution(job, 1, s, 2) for s in range(4)]
    elif spoil == "round":
        run[1] = contribution(job, 1, 1, 1, round_no=2)
    elif spoil == "slot-twice":  # each datagram is planned against the state before its burst
        run[2] = contribution(job, 1, 1, 1)
    before_alone = a.counters[Counter.DECLINED_DATAGRAMS]
    take_both(a, b, run, source)
    assert a.counters[Counter.DECLINED_DATAGRAMS] - before_alone == alone
    assert taken(a) - before == bursts
    same_state(a, b)


def test_slots_out_of_order_and_across_the_wrap_are_one_burst(
        pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    order = [6, 7, 0, 1, 3, 2]
    for rank in range(WORLD):
        out = take_both(a, b, [contribution(5, rank, s, 1, value=rank + 1.0) for s in order],
                        where(rank))
        assert taken(a) == rank + 1
    assert a.counters[Counter.DECLINED_DATAGRAMS] == 0
    assert [struct_slot(h) for _, h, _ in out] == order  # results leave in arrival order
    assert all(np.all(np.frombuffer(p, np.float32) == 6.0) for _, _, p in out)


def struct_slot(header: bytes) -> int:
    return unpack(header).slot


def test_a_slot_past_the_jobs_window_goes_alone(pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    take_both(a, b, [contribution(5, 0, s, 1) for s in range(4, SLOTS)]
              + [contribution(5, 0, SLOTS, 1)], where(0))
    assert taken(a) == 1
    assert a.counters[Counter.DECLINED_DATAGRAMS] == 1
    assert counters(a)[Counter.DROP_BAD_SLOT] == 1


def test_a_declined_run_of_garbage_is_counted_like_datagrams(
        pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    take_both(a, b, [b"\x00" * 10, b"\x01" * 10, b"\x02" * 7], where(0))
    assert counters(a)[Counter.DROP_MALFORMED] == 3


# ---- hypothesis: mixed runs, side by side ----

_SPOILS = st.sampled_from(["none"] * 6 + [
    "retransmit", "query", "cookie", "stranger", "garbage", "rank", "round", "short",
    "heartbeat", "unknown-job", "shuffle", "slot-twice", "next-use", "lost-before"])


@st.composite
def scenarios(draw: st.DrawFn) -> list[tuple[list[bytes], Address]]:
    """Rounds of window passes (uses 1, 2, 3) by every rank in a random order, cut into runs
    of consecutive slots, some shuffled, repeated, reordered or spoiled; now and then a run
    joined with the next (slots across the window's wrap). First transmissions carry each
    rank's send sequence, so that spoils, shuffles and reorderings make it skip (a loss, told
    with MISSING) and go back (a late one)."""
    runs: list[tuple[list[bytes], Address]] = []
    numbers: dict[tuple[int, int], int] = {}
    for use in range(1, draw(st.integers(1, 3)) + 1):
        for job in draw(st.permutations(list(JOBS))):
            for rank in draw(st.permutations(range(WORLD))):
                slot = 0
                while slot < SLOTS:
                    k = draw(st.integers(1, SLOTS - slot))
                    value = float(draw(st.integers(-4, 4)))
                    spoil = draw(_SPOILS)
                    first = numbers.get((job, rank), 0)
                    if spoil == "lost-before":  # numbers skipped: contributions lost
                        first += draw(st.integers(1, 3))
                    numbers[(job, rank)] = (first + k) % 256
                    run = [contribution(job, rank, s, use, value=value,
                                        sequence=(first + s - slot) % 256)
                           for s in range(slot, slot + k)]
                    source = where(rank)
                    i = draw(st.integers(0, k - 1))
                    if spoil == "retransmit":
                        run[i] = contribution(job, rank, slot + i, use, flags=Flags.RETRANSMIT)
                    elif spoil == "query":
                        run = [contribution(job, rank, s, use, kind=Kind.QUERY)
                               for s in range(slot, slot + k)]
                    elif spoil == "cookie":
                        run[i] = contribution(job, rank, slot + i, use, cookie=COOKIE ^ 1)
                    elif spoil == "stranger":
                        source = ("203.0.113.7", 4242)
                    elif spoil == "garbage":
                        run[i] = bytes(draw(st.binary(min_size=len(run[i]),
                                                      max_size=len(run[i]))))
                    elif spoil == "rank":
                        run[i] = contribution(job, (rank + 1) % WORLD, slot + i, use)
                    elif spoil == "round":
                        run[i] = contribution(job, rank, slot + i, use, round_no=9)
                    elif spoil == "short" and i == k - 1:
                        run[i] = contribution(job, rank, slot + i, use, length=PAYLOAD - 4)
                    elif spoil == "heartbeat":
                        beat = contribution(job, rank, slot, use, kind=Kind.HEARTBEAT)
                        run = [beat[:HEADER_SIZE]]
                    elif spoil == "shuffle":  # slots out of order (a window's releases)
                        run = draw(st.permutations(run))
                    elif spoil == "slot-twice":
                        run[i] = run[draw(st.integers(0, k - 1))]
                    elif spoil == "next-use":
                        run[i] = contribution(job, rank, slot + i, use + 1)
                    elif spoil == "unknown-job":
                        run = [contribution(99, rank, s, use) for s in range(slot, slot + k)]
                    runs.append((run, source))
                    if draw(st.booleans()) and draw(st.integers(0, 5)) == 0:
                        runs.append((run, source))  # a duplicate run
                    slot += k
    if len(runs) > 1 and draw(st.booleans()):
        i = draw(st.integers(0, len(runs) - 2))
        (first, source), (second, other) = runs[i], runs[i + 1]
        joined = first + second  # one coalesced receive: one size, but a shorter last
        if source == other and len(joined) <= SLOTS and len(joined[-1]) <= len(joined[0]) \
                and all(len(d) == len(joined[0]) for d in joined[:-1]):
            runs[i:i + 2] = [(joined, source)]
    if len(runs) > 1 and draw(st.booleans()):
        i, j = draw(st.integers(0, len(runs) - 1)), draw(st.integers(0, len(runs) - 1))
        runs[i], runs[j] = runs[j], runs[i]  # reordered
    return runs


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_mixed_runs_leave_both_paths_alike(runs: list[tuple[list[bytes], Address]]) -> None:
    arena_a, a = build()
    arena_b, b = build()
    try:
        for now, (run, source) in enumerate(runs):
            take_both(a, b, run, source, now=float(now))
        same_state(a, b)
    finally:
        arena_a.close()
        arena_b.close()


def test_slot_uses_wrap_past_the_header_field_on_both_paths(
        pair: tuple[Aggregator, Aggregator]) -> None:
    """A long job passes 2**32 uses of a slot (wire.WRAP): use WRAP is followed by use 1, on
    the burst path as one by one, and a late use from before the wrap is stale, not ahead."""
    a, b = pair
    for agg in pair:  # where 2**32 - 2 uses of every slot would have left them (white-box)
        for slot in agg._jobs[5].slots:
            slot.copies[slot.latest].use = WRAP - 1
    for use, round_no in ((WRAP, WRAP - 1), (1, WRAP), (2, 1)):
        for rank in range(WORLD):
            run = [contribution(5, rank, s, use, round_no=round_no, value=rank + 1.0)
                   for s in range(SLOTS)]
            out = take_both(a, b, run, where(rank))
        assert [unpack(h).use for _, h, _ in out] == [use] * SLOTS
        assert all(np.all(np.frombuffer(p, np.float32) == 6.0) for _, _, p in out)
    assert taken(a) == 3 * WORLD  # every run on the burst path
    assert [agg.stats(5, 0.0).rounds for agg in pair] == [1, 1]  # the newest round, past WRAP
    take_both(a, b, [contribution(5, 0, 0, WRAP, round_no=WRAP - 1)], where(0))  # before the wrap
    take_both(a, b, [contribution(5, 0, 1, 4, round_no=2)], where(0))  # beyond the next use
    assert [(agg.counters[Counter.DROP_STALE], agg.counters[Counter.DROP_WINDOW])
            for agg in pair] == [(1, 1), (1, 1)]
