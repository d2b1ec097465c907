"""A job of thousands of ranks (world sizes up to 4096 are admitted): what its heartbeats cost a
core, what a LIVENESS answer naming hundreds of silent ranks carries (a RoCE core could not
SEND one naming more than 337: counted unsendable, and its heartbeats went unanswered), and the
way the worker's error and the operator's status read then. benchmarks-journal.md, "A job of
a thousand ranks", has the measurements behind each."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reduction_appliance.control.jobtext import LISTED, job_lines, render_job
from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counters
from reduction_appliance.dataplane.errors import RankEnded, RankLeft, RankSilent
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.slotstate import TimedOutRanks
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.units import format_ranks
from reduction_appliance.dataplane.verbs import SEND_BYTES
from reduction_appliance.dataplane.wire import (
    IP_UDP_HEADERS,
    SILENT_RECORDS,
    Kind,
    SilentRank,
    silent_in_all,
    unpack,
    unpack_silent,
)
from reduction_appliance.plugin.stall import rank_verdict

from .feeding import feed
from .test_aggregator import COOKIE, KERNELS
from .test_upkeep import beat


def where(rank: int) -> tuple[str, int]:
    return (f"198.18.{rank // 200}.{10 + rank % 200}", 9000 + rank)


def spec(world: int, departed: frozenset[int] = frozenset()) -> JobSpec:
    return JobSpec(5, COOKIE, world, 2, endpoints=tuple(where(r) for r in range(world)),
                   departed=departed)


@pytest.fixture
def arena() -> Iterator[SlotArena]:
    with SlotArena(capacity=8, max_payload=1024, rx_buffers=32) as a:
        yield a


def test_ranks_are_written_as_runs() -> None:
    assert format_ranks([3, 0, 1, 2, 7, 9, 10, 2]) == "0-3, 7, 9, 10"
    assert format_ranks(range(2, 1024)) == "2-1023"
    assert format_ranks(range(0, 100, 2)) == "0, 2, 4, 6, 8, 10, 12, 14, and 42 more"
    assert format_ranks(range(0, 100, 2), runs=50) == ", ".join(map(str, range(0, 100, 2)))
    assert format_ranks([]) == ""


def test_a_liveness_names_the_most_telling_hundred_and_counts_them_all(
        arena: SlotArena) -> None:
    """A 1000-rank job: rank 0 heartbeats; rank 500's host said its port is closed (ended);
    rank 999 left; rank 998 fell silent later than the rest. The answer names 100 ranks,
    ended first, then the longest silent, whole in a 1280-byte datagram (any IPv4 path, a
    RoCE SEND), and counts all 999."""
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(1000, departed=frozenset({999})), 0.0)
    feed(agg, [(beat(998), where(998))], now=4.0)
    agg.reach([where(500)], 9.0)
    (answer,) = feed(agg, [(beat(0), where(0))], now=10.0)
    h = unpack(bytes(answer.header))
    assert h.kind is Kind.LIVENESS
    assert len(answer.header) + len(answer.payload) + IP_UDP_HEADERS <= 1280
    assert len(answer.header) + len(answer.payload) <= SEND_BYTES  # a RoCE core SENDs it
    named = unpack_silent(bytes(answer.payload))
    assert len(named) == SILENT_RECORDS and silent_in_all(h, named) == 999
    assert named[0] == SilentRank(500, where(500), 10.0, closed=True)
    assert [s.rank for s in named[1:]] == [r for r in range(1, 101) if r != 500][:99]
    assert all(s.silent_s == 10.0 and not s.left for s in named[1:])
    verdict = rank_verdict(named, 5, 5.0, unnamed=silent_in_all(h, named) - len(named))
    assert type(verdict) is RankEnded  # the ended rank decides, as with every record
    assert str(verdict).startswith(f"rank 500 ({where(500)[0]}:{where(500)[1]}) ended ")


def test_a_small_jobs_liveness_is_unchanged(arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(3), 0.0)
    feed(agg, [(beat(0), where(0)), (beat(1), where(1))], now=4.0)
    (answer,) = feed(agg, [(beat(0), where(0))], now=6.0)
    h = unpack(bytes(answer.header))
    assert unpack_silent(bytes(answer.payload)) == [SilentRank(2, where(2), 6.0)]
    assert silent_in_all(h, [SilentRank(2, where(2), 6.0)]) == 1


def _silent(ranks: range | list[int], seconds: float = 7.0, **kind: bool) -> list[SilentRank]:
    return [SilentRank(r, where(r), seconds, **kind) for r in ranks]


def test_a_workers_error_names_eight_ranks_and_counts_the_rest() -> None:
    verdict = rank_verdict(_silent(range(2, 102)), 5, 5.0, unnamed=900)
    text = str(verdict)
    assert type(verdict) is RankSilent and len(text) < 700
    assert text.startswith("rank 2 (198.18.0.12:9002); rank 3 (198.18.0.13:9003); ")
    assert "rank 9 (198.18.0.19:9009); and 992 more (10-101, ...) silent for 7.0 s" in text
    assert "rank 10 (" not in text


def test_ranks_cut_off_the_answer_are_counted_with_the_kind_it_ended_with() -> None:
    """The answer names the ended ranks first, the silent next, those that left last: the
    ones it could not name are silent ranks here, not ended ones."""
    ended = _silent([7], closed=True)
    assert str(rank_verdict(ended + _silent(range(20, 119)), 5, 5.0, unnamed=50)).startswith(
        "rank 7 (198.18.0.17:9007) ended without leaving job 5")
    left = rank_verdict(_silent(range(100), left=True), 5, 5.0, unnamed=3)
    assert type(left) is RankLeft and "; and 95 more (8-99, ...) left job 5" in str(left)
    few = rank_verdict(_silent([4, 6]), 5, 5.0)
    assert str(few).startswith("rank 4 (198.18.0.14:9004); rank 6 (198.18.0.16:9006) silent ")


def test_a_big_jobs_heartbeats_scan_its_ranks_a_few_times_a_timeout() -> None:
    """4096 ranks heartbeating every half second (the default timeout's tenth) for 20 s:
    163,840 answers, each of which scanned 4096 ranks before; now a scan comes once the
    oldest last word nears the timeout."""
    job = spec(4096)
    last_seen = [0.0] * 4096
    timed_out = TimedOutRanks()
    rng = random.Random(1)
    offsets = [rng.random() / 2 for _ in range(4096)]  # each rank's phase in its interval
    beats = sorted((k / 2 + offsets[r], r) for k in range(40) for r in range(4096))
    for now, rank in beats:
        last_seen[rank] = now
        assert timed_out.ranks(job, last_seen, now) == []
    assert timed_out.scans <= 6
    for rank in (17, 4000):  # two fall silent; the others still beat
        last_seen[rank] = 20.0
    for k in range(41, 62):
        now = k / 2
        for rank in range(4096):
            if rank not in (17, 4000):
                last_seen[rank] = now
        expected = [17, 4000] if now - 20.0 > 5.0 else []
        assert timed_out.ranks(job, last_seen, now) == expected
    assert timed_out.scans <= 12


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["time", "word", "outage", "join"]),
                          st.integers(0, 7), st.floats(0.0, 4.0)), max_size=60))
def test_timed_out_ranks_are_what_a_scan_of_every_rank_finds(
        steps: list[tuple[str, int, float]]) -> None:
    """Time passing, ranks speaking, an outage that rewrites every last word, ranks joining:
    after each, the ranks timed out are exactly those a scan finds."""
    timeout = 3.0
    job = JobSpec(5, COOKIE, 8, 2, endpoints=(where(0), None) * 4, liveness_timeout=timeout)
    last_seen = [0.0] * 8
    timed_out = TimedOutRanks()
    now = 0.0
    for what, rank, amount in steps:
        if what == "time":
            now += amount
        elif what == "word":
            last_seen[rank] = now
        elif what == "outage":  # upkeep.heartbeat: a fresh list, some ranks given `now`
            last_seen = [now if r % 3 == rank % 3 else seen for r, seen in enumerate(last_seen)]
        else:
            ends = list(job.endpoints)
            ends[rank] = where(rank)
            job = JobSpec(5, COOKIE, 8, 2, endpoints=tuple(ends), liveness_timeout=timeout)
        scan = [r for r, seen in enumerate(last_seen)
                if job.endpoints[r] is not None and now - seen > timeout]
        assert timed_out.ranks(job, last_seen, now) == scan


def _status_job(world: int, silent: dict[int, float], ended: frozenset[int] = frozenset(),
                lagging: int = 0, lossy: int = 0) -> dict[str, object]:
    joined = list(range(world - 1))  # the last rank left
    return {
        "job_id": 1, "name": "big", "state": "active", "world_size": world,
        "joined": joined, "epoch": 1, "rounds": 3, "bytes_reduced": 1 << 20,
        "last_activity_s": 0.2, "slots_per_core": 32, "segments_reduced": 1000,
        "lagging": {str(r): 0.1 + r / 1000 for r in range(lagging)},
        "silent": {str(r): s for r, s in silent.items()}, "ended": sorted(ended),
        "endpoints": {str(r): f"{where(r)[0]}:{where(r)[1]}" for r in range(world)},
        "contributions_missed": {str(r): 20 + r for r in range(lossy)},
    }


def test_a_thousand_silent_ranks_are_a_few_lines_of_status() -> None:
    """Status of a 1024-rank job that lost half its ranks: a line for each kind of silence,
    the ranks as runs, not 512 lines; the lagging column names the longest waited for; the
    lossy ranks past eight are one line."""
    silent = {r: 5.3 if r < 300 else 5.2 for r in range(512, 1023)}
    silent[1023] = 2.0  # left
    ended = frozenset(range(600, 700))
    job = _status_job(1024, silent, ended, lagging=600, lossy=20)
    lines = job_lines(job, 16)
    assert len(lines) == 1 + LISTED + 1 + 3, "\n".join(lines)
    assert lines[0].endswith("  599 (0.7s), 598 (0.7s), 597 (0.7s), 596 (0.7s), and 596 more")
    assert lines[LISTED].startswith("     ! rank 12 (198.18.0.22:9012) loses datagrams: 32 ")
    assert lines[LISTED + 1] == "     ! and 12 more ranks lose datagrams: ranks 0-11"
    assert lines[-3].startswith("     ! 100 ranks silent for 5.2 s, ended: their hosts say ")
    assert lines[-3].endswith(": ranks 600-699")
    assert lines[-2] == "     ! 411 ranks silent for 5.2 s: ranks 512-599, 700-1022"
    assert lines[-1] == "     ! rank 1023 (198.18.5.33:10023) left 2.0 s ago"
    few = job_lines(_status_job(4, {2: 5.5}), 16)
    assert few[1:] == ["     ! rank 2 (198.18.0.12:9002) silent for 5.5 s"]
    registration = {"job_id": 1, "name": "big", "state": "active", "world_size": 1024,
                    "joined": job["joined"], "endpoints": [], "multicast": None}
    assert "ranks: 1023 of 1024 joined [0-1022]" in render_job(registration, {})
