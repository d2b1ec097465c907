"""The burst path: a batch decoded at once and reduced in runs must leave exactly what the
careful path (one datagram at a time, every check) leaves: the same sends, byte for byte, the
same counters, the same job state. Batches in memory, mixed by hypothesis."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reduction_appliance.dataplane.aggregator import BURST_MIN, Aggregator
from reduction_appliance.dataplane.burst import decode_runs
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.errors import PeerError
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import RxBatch, Send
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
    unpack,
)

KERNELS = select_kernels()
GROUP = ("239.255.0.9", 7100)
COOKIE = 0x0BAD_CAFE_0000_0001
SEGMENT = 64  # payload bytes
SLOTS = 16  # a clean batch of one rank (one run) is as long as BURST_MIN
assert SLOTS >= BURST_MIN

Datagram = tuple[bytes, tuple[str, int]]


def where(job: int, rank: int) -> tuple[str, int]:
    return (f"198.18.{job}.{10 + rank}", 9000 + rank)


def job_spec(job: int, world: int, *, deterministic: bool = False,
             multicast: bool = True) -> JobSpec:
    return JobSpec(job, COOKIE + job, world, SLOTS, deterministic,
                   GROUP if multicast else None,
                   endpoints=tuple(where(job, r) for r in range(world)),
                   hold_buffers=world if deterministic else 0)


def datagram(h: Header, payload: bytes) -> bytes:
    header = bytearray(HEADER_SIZE)
    pack_into(header, h)
    return bytes(header) + payload


def contribution(job: int, rank: int, rnd: int, slot: int, *, dtype: DType = DType.FLOAT32,
                 op: Op = Op.SUM, flags: int = 0, kind: Kind = Kind.CONTRIBUTION,
                 cookie: int | None = None, use: int | None = None,
                 value: float | None = None) -> bytes:
    """Rank `rank`'s segment of slot `slot` in round `rnd` (one use of every slot a round)."""
    h = Header(kind, dtype, op, flags, job, rank, COOKIE + job if cookie is None else cookie,
               rnd, slot, (rnd * SLOTS + slot) * SEGMENT, SEGMENT, rnd if use is None else use,
               1)
    if kind is Kind.QUERY:
        return datagram(h, b"")
    item = 4 if dtype is DType.FLOAT32 else 2
    values = np.full(SEGMENT // item, rank + 1 + slot if value is None else value, np.float32)
    values += np.arange(len(values), dtype=np.float32)  # every element its own value
    if dtype is DType.FLOAT32:
        payload = values.tobytes()
    elif dtype is DType.FLOAT16:
        payload = values.astype(np.float16).tobytes()
    else:  # bfloat16: the top half of each float32 (exact for these small values)
        payload = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return datagram(h, payload)


@pytest.fixture
def arenas() -> Iterator[tuple[SlotArena, SlotArena]]:
    with SlotArena(64, 1024, 256) as a, SlotArena(64, 1024, 256) as b:
        yield a, b


def deliver(agg: Aggregator, batch: list[Datagram], now: float) -> list[tuple[object, ...]]:
    """Feed `batch` as one receive batch; the sends, as plain bytes (results are views of
    slot memory that the next batch may overwrite)."""
    rx = RxBatch()
    pool = agg.pool
    for data, source in batch:
        index = pool.take()
        assert index is not None
        pool.views[index][:len(data)] = data
        rx.add(index, len(data), source)
    sends: list[Send] = agg.on_batch(rx, now)
    return [(s.dest, bytes(s.header), bytes(s.payload)) for s in sends]


def counters(agg: Aggregator) -> dict[str, int]:
    snap = agg.counters.snapshot()
    snap.pop(Counter.BURST_CONTRIBUTIONS.name.lower())
    return snap


@pytest.mark.parametrize(("dtype", "op"), [(DType.FLOAT32, Op.SUM), (DType.FLOAT32, Op.AVG),
                                           (DType.FLOAT32, Op.MAX), (DType.FLOAT16, Op.SUM),
                                           (DType.BFLOAT16, Op.MIN)])
def test_clean_rounds_are_taken_by_the_burst_path(arenas: tuple[SlotArena, SlotArena],
                                                  dtype: DType, op: Op) -> None:
    burst = Aggregator(arenas[0], KERNELS, Counters())
    careful = Aggregator(arenas[1], KERNELS, Counters(), burst_min=sys.maxsize)
    for agg in (burst, careful):
        agg.add_job(job_spec(1, 3), 0.0)
    for round_no in (1, 2, 3):  # the receive pool hands buffers back in either order
        sent = []
        for rank in range(3):
            batch = [(contribution(1, rank, round_no, s, dtype=dtype, op=op,
                                   value=rank * 3 + s - 7.5), where(1, rank))
                     for s in range(SLOTS)]
            sent += deliver(burst, batch, 0.0)
            assert sent[-SLOTS:] == deliver(careful, batch, 0.0)[-SLOTS:]
        assert len(sent) == SLOTS
        for s, (dest, header, payload) in enumerate(sent):
            h = unpack(header)
            assert dest == GROUP and (h.kind, h.slot, h.round) == (Kind.RESULT, s, round_no)
            assert len(payload) == SEGMENT
    assert burst.counters[Counter.BURST_CONTRIBUTIONS] == 3 * 3 * SLOTS
    assert counters(burst) == counters(careful)
    assert burst.pool.free == len(burst.pool)


def test_a_short_datagram_is_malformed_whatever_its_buffer_held_before(
        arenas: tuple[SlotArena, SlotArena]) -> None:
    agg = Aggregator(arenas[0], KERNELS, Counters())
    agg.add_job(job_spec(1, 2), 0.0)
    heartbeat = datagram(Header(Kind.HEARTBEAT, DType.FLOAT32, Op.SUM, 0, 1, 0, COOKIE + 1,
                                1, 0, 0, 0, 0, 1), b"")
    assert deliver(agg, [(heartbeat, where(1, 0))], 0.0)  # answered: LIVENESS
    # The same buffer comes back for the next datagram; its 10 bytes must not borrow the
    # heartbeat's header that still sits there.
    assert deliver(agg, [(heartbeat[:10], where(1, 0))], 0.0) == []
    assert agg.counters[Counter.DROP_MALFORMED] == 1


def mixed_traffic(rnd: random.Random) -> list[Datagram]:
    """Rounds of two jobs (one deterministic) with every kind of trouble sprinkled in:
    drops, duplicates, reordering, retransmissions, queries, heartbeats, garbage, strangers,
    wrong cookies, another dtype, a rank out of range, diverging rounds. Round 1 is clean,
    so the first batches always hold runs the burst path takes."""
    traffic: list[Datagram] = []
    jobs = {1: 3, 2: 2, 3: 2}  # job -> world size (job 2 deterministic, 3 unicast)
    for round_no in range(1, 5):
        for job, world in jobs.items():
            ranks = list(range(world))
            rnd.shuffle(ranks)
            for rank in ranks:
                for slot in range(SLOTS):
                    data = contribution(job, rank, round_no, slot)
                    source = where(job, rank)
                    roll = rnd.random() if round_no > 1 else 1.0
                    if roll < 0.04:
                        continue  # lost
                    if roll < 0.07:
                        traffic.append((data, source))  # and duplicated below
                    elif roll < 0.09:
                        data = contribution(job, rank, round_no, slot, flags=Flags.RETRANSMIT)
                    elif roll < 0.11:
                        traffic.append((contribution(job, rank, round_no, slot,
                                                     kind=Kind.QUERY), source))
                    elif roll < 0.12:
                        data = contribution(job, rank, round_no, slot, cookie=7)
                    elif roll < 0.13:
                        source = ("198.18.99.99", 4242)
                    elif roll < 0.14:
                        data = data[:rnd.randrange(0, len(data))]
                    elif roll < 0.15:
                        data = bytes(rnd.randrange(256) for _ in range(rnd.randrange(60)))
                    elif roll < 0.16:
                        data = contribution(job, rank, round_no + 1, slot)  # diverges
                    elif roll < 0.17:
                        data = contribution(job, rank, round_no, slot, dtype=DType.FLOAT16)
                    elif roll < 0.18:
                        data = contribution(job, rank + world, round_no, slot)
                    elif roll < 0.19:
                        data = contribution(job, rank, round_no, slot, use=round_no + 2)
                    elif roll < 0.20:
                        traffic.append((datagram(Header(
                            Kind.HEARTBEAT, DType.FLOAT32, Op.SUM, 0, job, rank,
                            COOKIE + job, round_no, 0, 0, 0, 0, 1), b""), source))
                    traffic.append((data, source))
    clean = sum(jobs.values()) * SLOTS
    for _ in range(len(traffic) // 20):  # local reordering, after the clean round
        i = rnd.randrange(clean, len(traffic) - 1)
        traffic[i], traffic[i + 1] = traffic[i + 1], traffic[i]
    return traffic


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(rnd=st.randoms(use_true_random=False))
def test_the_burst_path_leaves_what_the_careful_path_leaves(
        arenas: tuple[SlotArena, SlotArena], rnd: random.Random) -> None:
    burst = Aggregator(arenas[0], KERNELS, Counters())
    careful = Aggregator(arenas[1], KERNELS, Counters(), burst_min=sys.maxsize)
    try:
        for job, world, deterministic, multicast in ((1, 3, False, True), (2, 2, True, True),
                                                     (3, 2, False, False)):
            for agg in (burst, careful):
                agg.add_job(job_spec(job, world, deterministic=deterministic,
                                     multicast=multicast), 0.0)
        traffic = mixed_traffic(rnd)
        now = 0.0
        size = 3 * SLOTS  # the clean round of job 1, whole
        while traffic:
            batch, traffic = traffic[:size], traffic[size:]
            now += 0.001
            # The same batches: a result is a view of its slot copy, which a later datagram
            # of the same batch may refill (that is why the loop sends before it receives).
            assert deliver(burst, batch, now) == deliver(careful, batch, now)
            assert counters(burst) == counters(careful)
            size = rnd.choice((BURST_MIN, 16, 24, 64, rnd.randrange(1, 80)))
        for job in (1, 2, 3):
            assert burst.stats(job, now) == careful.stats(job, now)
        assert burst.pool.free == careful.pool.free
        assert burst.counters[Counter.BURST_CONTRIBUTIONS] > 0  # the path under test ran
        assert careful.counters[Counter.BURST_CONTRIBUTIONS] == 0
    finally:
        for agg in (burst, careful):
            for job in (1, 2, 3):
                agg.remove_job(job)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 3)), min_size=1,
                max_size=40))
def test_runs_cover_the_batch_and_describe_every_datagram(
        script: list[tuple[int, bool, int]]) -> None:
    """Each entry: which rank, whether it is garbage, how far its slot jumps."""
    data = []
    slot = 0
    for rank, garbage, jump in script:
        slot += jump
        data.append(b"\x00" * 30 if garbage else contribution(1, rank, 1, slot))
    headers = np.zeros((len(data), HEADER_SIZE), np.uint8)
    for i, d in enumerate(data):
        headers[i, :min(len(d), HEADER_SIZE)] = np.frombuffer(d[:HEADER_SIZE], np.uint8)
    runs = decode_runs(headers, np.array([len(d) for d in data], np.uint64))
    assert runs.start[0] == 0 and sum(runs.size) == len(data)
    assert all(a + n == b for a, n, b in zip(runs.start, runs.size, runs.start[1:],
                                             strict=False))
    for r, start in enumerate(runs.start):
        for j in range(runs.size[r]):
            d = data[start + j]
            try:
                h = unpack(d) if len(d) >= HEADER_SIZE else None
            except PeerError:
                h = None
            fast = h is not None and h.kind is Kind.CONTRIBUTION and not h.flags
            assert runs.fast[r] == fast
            if not fast:
                assert runs.size[r] == 1
                continue
            assert h is not None
            assert (h.job_id, h.rank, h.cookie, h.round, h.use, h.length) == (
                runs.job_id[r], runs.rank[r], runs.cookie[r], runs.round[r], runs.use[r],
                runs.length[r])
            assert (h.slot, h.offset) == (runs.slot[r] + j, runs.offset[r] + j * h.length)
            assert (h.dtype, h.op, h.epoch) == (runs.dtype[r], runs.op[r], runs.epoch[r])
