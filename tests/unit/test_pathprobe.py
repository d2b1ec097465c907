"""Path probes at join (plugin/pathprobe.py) against the real aggregator's echoes: a path whose
links drop datagrams above some size, each way, on a simulated clock; no sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.errors import PathTooNarrow
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import Address
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    IP_UDP_HEADERS,
    DType,
    Header,
    Kind,
    Op,
    pack_into,
    unpack,
)
from reduction_appliance.plugin.pathprobe import (
    BUDGET_S,
    SILENT_S,
    STALL_S,
    TRIES_FOR_VERDICT,
    TRY_EVERY_S,
    PathProbe,
    PathTarget,
    PathWatch,
    Verdict,
    ladder,
    narrow_error,
    reason_for_peers,
)

from .feeding import feed

SEGMENT = 8896  # an MTU 9000 path's segments
JUMBO = SEGMENT + HEADER_SIZE + IP_UDP_HEADERS  # 9000 less the Ethernet header: 8972 B
COOKIE = 0x0DDC_0FFE_E15B_AD00
CORE = ("198.18.0.1", 7000)
WORKER = ("198.18.0.103", 40000)
TARGET = PathTarget(CORE, 5, 2, COOKIE, 1)


@pytest.fixture
def agg() -> Iterator[Aggregator]:
    with SlotArena(capacity=8, max_payload=SEGMENT, rx_buffers=32) as arena:
        agg = Aggregator(arena, select_kernels(), Counters())
        endpoints = (("198.18.0.101", 1), ("198.18.0.102", 1), WORKER)
        agg.add_job(JobSpec(5, COOKIE, 3, 2, False, None, epoch=1, endpoints=endpoints), 0.0)
        yield agg


def wire_size(datagram: bytes | int) -> int:
    """The IP datagram a UDP payload of ours travels as (what an MTU bounds)."""
    return (datagram if isinstance(datagram, int) else len(datagram)) + IP_UDP_HEADERS


Passes = Callable[[int], bool]


def run(agg: Aggregator, up: Passes, down: Passes,
        lost_at_random: Callable[[int], bool] = lambda _: False) -> tuple[list[Verdict], float]:
    """Drive a probe of TARGET until it has an outcome: each datagram crosses the path if its
    size `up` (or `down`) passes and `lost_at_random(n)` spares it; (verdicts, time taken)."""
    now = 0.0
    probe = PathProbe([TARGET], SEGMENT, now)
    sent = [0]
    while True:
        cross(agg, probe.due(now), now, up, down, probe.answered, lost_at_random, sent)
        if (verdicts := probe.outcome(now)) is not None:
            return verdicts, now
        now = probe.next_at()


def cross(agg: Aggregator, datagrams: list[tuple[Address, bytes]], now: float, up: Passes,
          down: Passes, answered: Callable[[Header, Address], None],
          lost_at_random: Callable[[int], bool] = lambda _: False, sent: list[int] | None = None
          ) -> None:
    """Carry probes to the aggregator and its echoes back over the path `up` and `down`."""
    sent = [0] if sent is None else sent
    for dest, datagram in datagrams:
        assert dest == CORE
        sent[0] += 1
        if not up(wire_size(datagram)) or lost_at_random(sent[0]):
            continue
        for echo in feed(agg, [(datagram, WORKER)], now):
            sent[0] += 1
            reply = bytes(echo.header) + bytes(echo.payload)
            assert echo.dest == WORKER
            if down(wire_size(reply)) and not lost_at_random(sent[0]):
                answered(unpack(reply), CORE)


def watch(agg: Aggregator, path: PathWatch, quiet_since: float | None, start: float,
          until: float, up: Passes = lambda _: True, down: Passes = lambda _: True
          ) -> tuple[list[Verdict] | None, float]:
    """Turn `path` as the client does (its outcome, then what is due) from `start` while the
    rounds have taken no result since `quiet_since`, until a narrow verdict or `until`."""
    now = start
    while now < until:
        if (verdicts := path.outcome(now, quiet_since)) is not None:
            return verdicts, now
        cross(agg, path.due(now, quiet_since), now, up, down, path.answered)
        now = max(now, min(path.next_at(quiet_since), until))
    return None, now


def under(mtu: int) -> Passes:
    return lambda size: size <= mtu


def test_the_ladder_is_the_common_mtus_below_the_job_and_the_job_itself() -> None:
    assert [wire_size(s + HEADER_SIZE) for s in ladder(SEGMENT)] == [1280, 1500, 4096, JUMBO]
    assert [wire_size(s + HEADER_SIZE) for s in ladder(1424)] == [1280, 1500]
    assert ladder(1000) == [1000]  # below every common MTU: the job's own alone


def test_a_clean_path_is_settled_in_one_try(agg: Aggregator) -> None:
    (verdict,), took = run(agg, under(9000), under(9000))
    assert not verdict.narrow and took == 0.0  # every echo in the first try
    assert verdict.up_ok == verdict.down_ok == [1280, 1500, 4096, JUMBO]
    # the header-only probe and four sizes each way, every one echoed
    assert agg.counters[Counter.PATH_PROBES] == 9


@pytest.mark.parametrize(("up_mtu", "down_mtu"), [(1500, 1500), (9000, 1500), (4096, 9000)])
def test_a_narrow_link_is_found_each_way_with_the_sizes_that_pass(
        agg: Aggregator, up_mtu: int, down_mtu: int) -> None:
    (verdict,), took = run(agg, under(up_mtu), under(down_mtu))
    assert verdict.narrow
    sizes = [1280, 1500, 4096, JUMBO]
    assert verdict.up_ok == [s for s in sizes if s <= up_mtu]
    assert verdict.up_lost == [s for s in sizes if s > up_mtu]
    assert verdict.down_ok == [s for s in sizes if s <= down_mtu]
    assert verdict.down_lost == [s for s in sizes if s > down_mtu]
    # decided once the header-only probe came back often enough, well within the budget
    assert took == pytest.approx((TRIES_FOR_VERDICT - 1) * TRY_EVERY_S)


def test_the_error_says_which_sizes_passed_and_what_to_set(agg: Aggregator) -> None:
    verdicts, _ = run(agg, under(1500), under(9000))
    error = narrow_error(2, verdicts, SEGMENT)
    assert isinstance(error, PathTooNarrow)
    text = str(error)
    assert text.startswith("rank 2: the path between this host and appliance "
                           "198.18.0.1:7000 loses this job's datagrams (8972 B, for 8896 B "
                           "segments) while 76 B ones pass both ways"), text
    assert "to the appliance, 4096 B and more are lost (1280 and 1500 B arrive)" in text
    assert "from it" not in text  # that way carries them all
    assert "an MTU of at least 8972" in text
    assert "or set the appliance's dataplane.mtu to 1500 (segments of 1424 B)" in text


def test_cores_whose_paths_agree_are_named_together_and_whole_paths_apart() -> None:
    """Each core listens on its own port, and a port can hash onto another member of an ECMP
    group or a LAG: a narrow member shows as some cores' paths narrow, the others whole."""
    sizes = [1280, 1500, 4096, JUMBO]

    def at(port: int, up_mtu: int, down_mtu: int) -> Verdict:
        return Verdict(PathTarget(("198.18.0.1", port), 5, 2, COOKIE, 1),
                       [s for s in sizes if s <= up_mtu], [s for s in sizes if s > up_mtu],
                       [s for s in sizes if s <= down_mtu], [s for s in sizes if s > down_mtu])

    text = str(narrow_error(2, [at(7000, 1500, 4096), at(7001, 9000, 9000),
                                at(7002, 1500, 4096)], SEGMENT))
    assert text.startswith(
        "rank 2: the paths between this host and appliance cores 198.18.0.1:7000, "
        "198.18.0.1:7002 lose this job's datagrams (8972 B, for 8896 B segments) while 76 B "
        "ones pass both ways: to the appliance, 4096 B and more are lost (1280 and 1500 B "
        "arrive); from it, 8972 B and more are lost (1280, 1500 and 4096 B arrive). The paths "
        "to 198.18.0.1:7001 carry them whole: a link on some paths only (a member of an ECMP "
        "group or a LAG) has the smaller MTU."), text
    assert "dataplane.mtu to 1500 (segments of 1424 B)" in text  # what passes every way
    text = str(narrow_error(2, [at(7000, 1000, 9000)], SEGMENT))
    assert "to the appliance, 1280 B and more are lost (none of the sizes tried arrives)" in text
    assert text.endswith("an MTU of at least 8972, or find the link that drops them.")


def test_random_loss_alone_is_never_taken_for_a_narrow_path(agg: Aggregator) -> None:
    """20% of datagrams lost each way, whatever their size (a lossy-link test's rack): every
    size gets through within the budget, and no verdict says narrow."""
    import random

    rng = random.Random(7)
    for _ in range(50):
        verdicts, _ = run(agg, under(9000), under(9000), lambda _n: rng.random() < 0.2)
        assert verdicts and not any(v.narrow for v in verdicts)


def test_nothing_back_at_all_is_no_verdict_and_soon(agg: Aggregator) -> None:
    """A firewall, a NAT, or an appliance gone: the probe says nothing (the client's silence
    diagnosis does, at the first allreduce, before the job's liveness timeout evicts it) and
    gives up once the core has been silent for SILENT_S."""
    verdicts, took = run(agg, lambda _: False, under(9000))
    assert verdicts == [] and SILENT_S <= took < SILENT_S + TRY_EVERY_S


def test_a_silent_core_holds_up_no_verdict_on_the_others() -> None:
    """Two cores: one echoes only header-only probes (narrow), the other nothing at all.
    The narrow one is judged as soon as it can be; the silent one is left out."""
    narrow, silent = TARGET, PathTarget(("198.18.0.1", 7001), 5, 2, COOKIE, 1)
    probe = PathProbe([narrow, silent], SEGMENT, 0.0)
    now, tries = 0.0, 0
    while (verdicts := probe.outcome(now)) is None:
        assert now < BUDGET_S
        probe.due(now)
        tries += 1
        probe.answered(Header(Kind.PATH_ECHO, DType.FLOAT32, Op.SUM, 0, 5, 2, COOKIE, tries,
                              0, 0, 0), CORE)
        now = probe.next_at()
    assert [v.target for v in verdicts] == [narrow] and verdicts[0].narrow
    assert now == pytest.approx(max(SILENT_S, TRIES_FOR_VERDICT * TRY_EVERY_S))


def probe_datagram(up: int, down: int, *, cookie: int = COOKIE, length: int | None = None,
                   rank: int = 2) -> bytes:
    buf = bytearray(HEADER_SIZE + up)
    pack_into(buf, Header(Kind.PATH_PROBE, DType.FLOAT32, Op.SUM, 0, 5, rank, cookie, 9, 0,
                          down, up if length is None else length, 0, 1))
    return bytes(buf)


def test_the_echo_carries_the_size_that_came_padded_to_the_size_asked(
        agg: Aggregator) -> None:
    (echo,) = feed(agg, [(probe_datagram(1000, 3000), WORKER)])
    h = unpack(bytes(echo.header))
    assert (h.kind, h.offset, h.length, h.round, h.rank) == (Kind.PATH_ECHO, 1000, 3000, 9, 2)
    assert bytes(echo.payload) == bytes(3000) and echo.dest == WORKER
    assert agg.counters[Counter.PATH_ECHO_BYTES] == HEADER_SIZE + 3000


def test_only_a_bound_rank_gets_an_echo_and_never_longer_than_a_segment(
        agg: Aggregator) -> None:
    """An echo padded to a size asked is an amplifier: a stranger (another cookie, another
    source) gets nothing, nor does a probe that asks for more than a segment or lies about
    its own length."""
    assert feed(agg, [(probe_datagram(0, 4000, cookie=1), WORKER)]) == []
    assert feed(agg, [(probe_datagram(0, 4000), ("203.0.113.9", 40000))]) == []
    assert feed(agg, [(probe_datagram(0, SEGMENT + 1), WORKER)]) == []
    assert feed(agg, [(probe_datagram(10, 0, length=20), WORKER)]) == []
    counters = agg.counters
    assert (counters[Counter.DROP_BAD_COOKIE], counters[Counter.DROP_BAD_SOURCE],
            counters[Counter.DROP_BAD_LENGTH], counters[Counter.PATH_PROBES]) == (1, 1, 2, 0)


def test_echoes_of_another_job_or_kind_are_ignored() -> None:
    probe = PathProbe([TARGET], SEGMENT, 0.0)
    probe.due(0.0)
    for h in (Header(Kind.PATH_ECHO, DType.FLOAT32, Op.SUM, 0, 6, 2, COOKIE, 1, 0, 0, 0),
              Header(Kind.PATH_ECHO, DType.FLOAT32, Op.SUM, 0, 5, 2, 1, 1, 0, 0, 0),
              Header(Kind.LIVENESS, DType.FLOAT32, Op.SUM, 0, 5, 2, COOKIE, 1, 0, 0, 0)):
        for round_no in range(1, 40):
            probe.answered(h._replace(round=round_no), CORE)
    probe.answered(Header(Kind.PATH_ECHO, DType.FLOAT32, Op.SUM, 0, 5, 2, COOKIE, 1, 0, 0, 0),
                   ("198.18.0.2", 7000))  # from another appliance than the one probed
    assert probe.outcome(1.0) == []  # nothing counted: a silent core, no verdict


def test_a_duplicated_echo_counts_once() -> None:
    probe = PathProbe([TARGET], SEGMENT, 0.0)
    baseline = Header(Kind.PATH_ECHO, DType.FLOAT32, Op.SUM, 0, 5, 2, COOKIE, 1, 0, 0, 0)
    for _ in range(TRIES_FOR_VERDICT):
        probe.answered(baseline, CORE)
    assert probe.outcome(1.0) is None  # one try's echo, many times: not enough


def test_the_watch_probes_a_stall_only_and_less_often_the_longer_it_lasts(
        agg: Aggregator) -> None:
    """Mid-job: nothing while no round is in flight or results come; a stall is probed
    STALL_S into it, then 2, 4, 8 and 16 s into it (sound paths: a slow peer), and a result
    starts over."""
    path = PathWatch(lambda: [TARGET], SEGMENT)
    assert path.next_at(None) == float("inf") and path.due(5.0, None) == []
    assert path.due(10.0 + STALL_S / 2, 10.0) == []
    verdicts, _ = watch(agg, path, 10.0, 10.0, 40.0)
    assert verdicts is None and path.probes == 5  # at 11, 12, 14, 18 and 26 s
    assert path.next_at(10.0) == 10.0 + 32 * STALL_S
    assert agg.counters[Counter.PATH_PROBES] == 5 * 9  # each settled in its first try
    assert path.next_at(39.0) == 39.0 + STALL_S  # a result at 39 s: a new stall


def test_a_path_narrowed_mid_job_is_found_within_two_seconds_of_the_stall(
        agg: Aggregator) -> None:
    """The switch port under rank 2 set to 1500 while the job runs: its rounds take no
    result from then on. The watch names the path 2.6 s into the stall (two probes agree),
    saying it changed under the job; its peers read a reason that fits the API's 256 characters."""
    path = PathWatch(lambda: [TARGET], SEGMENT)
    verdicts, now = watch(agg, path, 3.0, 3.0, 10.0, under(1500), under(1500))
    assert verdicts is not None and verdicts[0].narrow
    assert path.probes == 2  # the second confirms the first: the job is aborted on them
    # (each read at the turn after the last echo needed, as the client does)
    assert now - 3.0 == pytest.approx(STALL_S + 2 * TRIES_FOR_VERDICT * TRY_EVERY_S)
    text = str(narrow_error(2, verdicts, SEGMENT, stalled_s=now - 3.0))
    assert text.startswith("rank 2: the path between this host and appliance 198.18.0.1:7000 "
                           "loses this job's datagrams (8972 B, for 8896 B segments)"), text
    assert text.endswith("segments of 1424 B). Found mid-job, 2.6 s without a result: a link "
                         "on the path changed since this rank joined."), text
    reason = reason_for_peers(verdicts, SEGMENT)
    assert reason == ("its path to the appliance loses this job's 8972 B datagrams while 1500 "
                      "B ones pass (a link between has a smaller MTU than both ends); that "
                      "rank's error says what to change")
    assert len(f"at rank 2's request: {reason}") <= 256


def test_a_narrow_look_that_the_next_probe_does_not_confirm_is_forgotten(
        agg: Aggregator) -> None:
    """A path that drops large datagrams through one probe's tries only (a receive buffer
    kept too full for them) is not taken for narrow: the probe that confirms finds it
    sound, and the stall goes on being watched as before."""
    path = PathWatch(lambda: [TARGET], SEGMENT)
    verdicts, now = watch(agg, path, 0.0, 0.0, 1.9, under(1500), under(1500))
    assert verdicts is None and path.probes == 2  # the first found it narrow at 1.8 s
    verdicts, now = watch(agg, path, 0.0, now, 10.0)  # then every size passes again
    assert verdicts is None and path.probes == 5  # found sound; then at 2, 4 and 8 s


def test_a_result_taken_during_a_probe_ends_it_without_a_verdict(agg: Aggregator) -> None:
    """Results that come while the paths are probed prove they carry the job's datagrams: a
    probe under way then says nothing, whatever its large sizes met."""
    path = PathWatch(lambda: [TARGET], SEGMENT)
    assert path.due(1.0, 0.0)  # the stall since 0.0 is probed
    assert path.outcome(1.9, 1.5) is None  # a result at 1.5 s
    assert path.next_at(1.5) == 1.5 + STALL_S and path.probes == 1
    verdicts, _ = watch(agg, path, 1.5, 1.9, 10.0)  # and the new stall is watched anew
    assert verdicts is None and path.probes == 5  # at 2.5, 3.5, 5.5 and 9.5 s
