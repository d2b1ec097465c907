"""The congestion window (plugin/congestion.py): its arithmetic with plain numbers, its gate,
and on the simulated network: an incast at the appliance's link, and deadlock freedom with
windows of one segment under loss."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.wire import HEADER_SIZE, DType, Flags, Kind, Op, pack_into
from reduction_appliance.plugin.congestion import (
    Congestion,
    CongestionWindow,
    admit,
    any_admitted,
    fitting_window,
)
from reduction_appliance.plugin.rtt import RttEstimator, Timing
from reduction_appliance.plugin.session import AllreduceRound, Endpoint, Transmit

from .simnet import Bottleneck, Faults, SimNet

KERNELS = select_kernels()
POLICY = Congestion(target=0.02, min_window=2, beta=0.8, max_decrease=0.5, mark_decrease=0.2)


def test_a_window_starts_whole_and_a_sample_below_target_leaves_it() -> None:
    w = CongestionWindow([32, 16], POLICY)
    assert w.limit == [32, 16] and not w.shrunk
    w.on_delay(0, 0.019, now=1.0)
    w.on_answer(0)
    assert w.limit == [32, 16] and not w.shrunk and w.cuts == 0 and w.samples == 1


def test_one_receive_turn_over_target_is_no_queue() -> None:
    w = CongestionWindow([32], POLICY)
    w.on_delay(0, 0.005, now=0.9)
    for _ in range(5):  # a worker not run for half a second: every sample of its next turn
        w.on_delay(0, 0.5, now=1.0)
    assert w.limit == [32] and not w.queued[0] and w.cuts == 0
    w.on_delay(0, 0.005, now=1.1)
    w.on_delay(0, 0.5, now=1.2)
    assert w.limit == [32] and w.cuts == 0
    w.on_delay(0, 0.03, now=1.3)  # two turns in a row over target: the lesser, 30 ms, counts
    assert w.queued[0] and w.cuts == 1 and w.limit == [int(32 * (1 - 0.8 * 0.01 / 0.03))]


def test_a_queue_cuts_in_proportion_to_its_excess_once_per_round_trip() -> None:
    w = CongestionWindow([32, 32], POLICY)
    w.on_delay(0, 0.03, now=0.99)
    w.on_delay(0, 0.025, now=1.0)  # the lesser of two: 5 ms over 20: 1 - 0.8 * 5/25 = 0.84
    assert w.limit == [26, 32] and w.shrunk and w.cuts == 1 and w.queued == [True, False]
    w.on_delay(0, 0.1, now=1.02)  # within the round trip after the cut: its effect not yet due
    assert w.limit[0] == 26 and w.cuts == 1
    w.on_delay(0, 0.1, now=1.2)  # later: cut again, by at most half
    assert w.limit[0] == 13 and w.cuts == 2
    for t in range(10):  # and never below the floor
        w.on_delay(0, 1.0, now=3.0 + 2 * t)
    assert w.limit[0] == 2 and w.least == 2
    assert w.limit[1] == 32  # each core its own window


def test_a_peers_mark_cuts_by_a_fixed_share_once_per_round_trip_and_its_absence_clears() -> None:
    w = CongestionWindow([20], POLICY)
    w.on_mark(0, True, now=1.0, rtt=0.05)
    assert w.limit == [16] and w.queued == [True]  # 20 * (1 - 0.2)
    assert w.measured == [False]  # passed on to no one: only its own samples are
    w.on_mark(0, True, now=1.02, rtt=0.05)
    assert w.limit == [16] and w.cuts == 1
    w.on_answer(0)  # no growth while marked
    assert w.limit == [16]
    w.on_mark(0, False, now=1.03, rtt=0.05)
    assert w.queued == [False]
    for _ in range(17):
        w.on_answer(0)
    assert w.limit == [17]


def test_answers_grow_a_shrunk_window_one_segment_per_window_and_no_further_than_whole() -> None:
    w = CongestionWindow([8], POLICY)
    w.on_delay(0, 1.0, now=0.5)
    w.on_delay(0, 1.0, now=1.0)
    assert w.limit == [4]
    w.on_answer(0)  # the latest sample said a queue stands: no growth
    assert w.limit == [4]
    w.on_delay(0, 0.001, now=2.0)
    for _ in range(4):  # 1/4 + 1/4.25 + ...: not quite one segment yet
        w.on_answer(0)
    assert w.limit == [4]
    w.on_answer(0)  # about a window's worth of answers: one segment more
    assert w.limit == [5]
    for _ in range(100):
        w.on_answer(0)
    assert w.limit == [8] and not w.shrunk


def test_a_disabled_policy_keeps_the_window_whole() -> None:
    w = CongestionWindow([8], Congestion(enabled=False))
    w.on_delay(0, 10.0, now=1.0)
    assert w.limit == [8] and not w.shrunk and w.samples == 0


@pytest.mark.parametrize("bad", [dict(target=0.0), dict(target=-1.0), dict(min_window=0),
                                 dict(max_decrease=1.0), dict(max_decrease=0.0)])
def test_a_policy_out_of_range_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="out of range"):
        Congestion(**bad)  # type: ignore[arg-type]


def test_the_gate_sends_lowest_first_within_room_and_the_lowest_unanswered_always() -> None:
    ready = deque([6, 2, 4, 3, 5, 7])  # two cores: even to core 0, odd to core 1
    in_flight, limit = [3, 4], [4, 4]
    go = admit(ready, 2, in_flight, limit, lowest=[2, 1])
    # Core 0 has room for one: 2, its lowest. Core 1 none; 3 is not its lowest unanswered (1).
    assert list(go) == [2] and list(ready) == [3, 4, 5, 6, 7]
    assert not any_admitted(ready, 2, [4, 4], limit, lowest=[2, 1])
    go = admit(ready, 2, [4, 4], limit, lowest=[4, 3])  # full, but each core's lowest goes
    assert list(go) == [3, 4] and list(ready) == [5, 6, 7]
    assert any_admitted(ready, 2, [4, 4], limit, lowest=[6, 9])


GateState = tuple[int, deque[int], list[int], list[int], list[int]]


@st.composite
def gate_states(draw: st.DrawFn) -> GateState:
    """A gate's question: cores; the segments ready, in no particular order; per core the
    segments in flight, the window, and the round's lowest unanswered segment (its own)."""
    cores = draw(st.integers(1, 3))
    per_core = st.lists(st.integers(0, 6), min_size=cores, max_size=cores)
    segments = draw(st.sets(st.integers(0, 40), max_size=30))
    in_flight = draw(per_core)
    limit = [w + 1 for w in draw(per_core)]
    lowest = [low - low % cores + e for e, low in enumerate(
        draw(st.lists(st.integers(0, 44), min_size=cores, max_size=cores)))]
    ready = deque(sorted(segments, key=lambda k: (k * 7) % 41))
    return cores, ready, in_flight, limit, lowest


@given(gate_states())
def test_the_gate_says_it_would_admit_exactly_when_it_admits(state: GateState) -> None:
    # `any_admitted` answers each turn without admitting: it must agree with `admit` itself.
    cores, ready, in_flight, limit, lowest = state
    expected = bool(admit(deque(ready), cores, in_flight, limit, lowest))
    assert any_admitted(ready, cores, in_flight, limit, lowest) is expected


def _admit_one_by_one(ready: deque[int], cores: int, in_flight: list[int], limit: list[int],
                      lowest: list[int]) -> deque[int]:
    """The gate's rule, segment by segment: what `admit` must do, however it does it."""
    room = [limit[e] - in_flight[e] for e in range(cores)]
    go: deque[int] = deque()
    held: list[int] = []
    for k in sorted(ready):
        e = k % cores
        if room[e] > 0 or k == lowest[e]:
            room[e] -= 1
            go.append(k)
        else:
            held.append(k)
    ready.clear()
    ready.extend(held)
    return go


@given(gate_states())
def test_the_gate_admits_as_its_rule_says_segment_by_segment(state: GateState) -> None:
    cores, ready, in_flight, limit, lowest = state
    expected_ready = deque(ready)
    expected = _admit_one_by_one(expected_ready, cores, in_flight, limit, lowest)
    assert admit(ready, cores, in_flight, limit, lowest) == expected
    assert ready == expected_ready


def _rounds(net: SimNet, count: int, elements: int) -> list[float]:
    """`count` allreduces of integer values on every rank, each checked; their times."""
    times = []
    for i in range(count):
        arrays = [np.full(elements, r + i, np.float32) for r in range(net.world)]
        start = net.now
        net.allreduce(arrays, DType.FLOAT32, Op.SUM)
        times.append(net.now - start)
        want = sum(r + i for r in range(net.world))
        assert all((a == want).all() for a in arrays)
    return times


def _incast(congestion: Congestion | None, seed: int) -> tuple[SimNet, list[tuple[float, int]]]:
    """Eight ranks' whole windows (8 x 16 segments of 8 KiB: 1.05 MB) into an appliance link
    that queues 625 KB (50 ms at 100 Mbit/s) before it drops, as the emulated rack's tbf does:
    each round's time and the datagrams the link dropped in it."""
    link = Bottleneck(rate=12.5e6, queue_s=0.05)
    net = SimNet(KERNELS, 8, cores=1, slots=16, max_payload=8192,
                 faults=Faults(max_delay=0.0002, seed=seed), timing=Timing(0.05, 0.01, 1.0, 60.0),
                 congestion=congestion, bottleneck=link)
    rounds = []
    for _ in range(5):
        before = link.dropped
        rounds.append((_rounds(net, 1, 1 << 17)[0], link.dropped - before))  # 512 KiB each
    net.close()
    return net, rounds


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_an_incast_at_the_appliance_link_stops_dropping_once_the_windows_shrink(
        seed: int) -> None:
    """The job's first burst overflows the queue either way. Then fixed windows go on
    overflowing it every round, each loss waiting for its repair; the shrinking windows settle
    within three rounds (two on most seeds), keep it below its bound, and every round then
    takes the link's time (4 MiB at 100 Mbit/s: 336 ms)."""
    _, fixed = _incast(None, seed)
    net, shrunk = _incast(Congestion(target=0.025), seed)
    assert all(dropped > 100 for _, dropped in fixed)
    assert shrunk[0][1] > 100  # the first burst
    assert sum(dropped for _, dropped in shrunk[3:]) <= 5  # settled within three rounds
    ideal = 8 * (1 << 19) / 12.5e6
    assert all(t < 1.03 * ideal for t, _ in shrunk[3:])
    assert all(t > 1.05 * ideal for t, _ in fixed)
    # Every rank shrank its window, the completers by their samples, the others by the echo.
    assert all(w is not None and w.cuts > 0 and w.limit[0] < 16 for w in net.windows)


def test_windows_of_one_segment_never_deadlock_under_loss_and_reordering() -> None:
    """Every completer sample is over target, so every window falls to one segment; ranks
    release segments in whatever order their results came (20% loss each way, reordering).
    Without the lowest unanswered segment's exemption two ranks' windows would hold
    different segments and each wait for the other until the deadline."""
    policy = Congestion(target=1e-9, min_window=1, max_decrease=0.9)
    net = SimNet(KERNELS, 4, cores=2, slots=8, max_payload=256,
                 faults=Faults(drop=0.2, max_delay=0.003, seed=11), congestion=policy)
    _rounds(net, 6, 64 * 32)  # 32 segments per core per round: four times the slots
    assert all(w is not None and w.least == 1 for w in net.windows)
    net.close()


def test_a_full_window_finds_a_waiting_lowest_segment_as_the_gate_would(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`wakeup` asks each turn whether the shrunk window admits anything; while it is full it
    answers from which lowest segments were never sent, not from a scan of `ready`. Checked
    against the gate itself on every question of lossy, reordered rounds at windows of one."""
    answers: list[bool] = []
    shortcut = AllreduceRound._admits_any

    def checked(rnd: AllreduceRound, limit: list[int]) -> bool:
        got = shortcut(rnd, limit)
        n_ep = len(rnd.endpoints)
        assert got is any_admitted(rnd._ready, n_ep, rnd._in_flight, limit, rnd._lowest)
        if all(rnd._in_flight[e] >= limit[e] for e in range(n_ep)):
            answers.append(got)
        return got

    monkeypatch.setattr(AllreduceRound, "_admits_any", checked)
    policy = Congestion(target=1e-9, min_window=1, max_decrease=0.9)
    net = SimNet(KERNELS, 4, cores=2, slots=8, max_payload=256,
                 faults=Faults(drop=0.2, max_delay=0.003, seed=12), congestion=policy)
    _rounds(net, 3, 64 * 32)
    net.close()
    assert False in answers  # the windows were full: the shortcut answered


def test_a_round_whose_lowest_segment_waits_behind_anothers_full_window_goes_at_once() -> None:
    """Two rounds in flight together share a core's window (the lanes of plugin/pipeline.py):
    the first fills it, and the second's lowest segment, never sent, must still go."""
    ep = (Endpoint(("198.18.0.1", 7000), 5, 77, 4, "core 0"),)
    window, in_flight = CongestionWindow([4]), [0]
    window._set(0, 2.0)  # shrunk to two segments
    rtt = RttEstimator()
    first, second = (AllreduceRound(ep, 0, 2, no, DType.FLOAT32, Op.SUM, 4096, 256, rtt, 0.0,
                                    in_flight=in_flight, window=window) for no in (1, 2))
    assert [t.segment for t in first.due(0.0)] == [0, 1] and in_flight == [2]
    assert first.wakeup() > 0.0  # full: its next segments wait for room
    assert second.wakeup() == 0.0  # full too, but its lowest segment was never sent
    assert [t.segment for t in second.due(0.0)] == [0] and in_flight == [3]
    assert second.wakeup() > 0.0  # now only room lets more go


def test_contributions_carry_their_senders_own_measure_and_a_gated_round_waits_for_room() -> None:
    """QUEUED on a contribution is the sender's own samples' verdict, never a peer's echoed
    mark (passed on, the appliance would echo it again and again); and a round whose window
    is full sends nothing more and asks to be woken by no timer of the window's."""
    endpoint = (Endpoint(("a", 0), 1, 99, 8, "appliance core 0"),)
    window = CongestionWindow([8], POLICY)
    rnd = AllreduceRound(endpoint, 0, 2, 1, DType.FLOAT32, Op.SUM, 16 * 64, 64,
                         RttEstimator(Timing()), 0.0, window=window)
    window.on_mark(0, True, now=0.0, rtt=0.05)  # a peer's mark: 8 -> 6
    first = rnd.due(0.0)
    assert [t.segment for t in first] == list(range(6))  # the window's room, lowest first
    assert all(not t.header.flags & Flags.QUEUED for t in first)
    assert rnd.wakeup() > 0.0  # segments 6 and 7 wait for room, not a busy loop
    window.on_delay(0, 0.05, now=0.01)
    window.on_delay(0, 0.05, now=0.02)  # two turns over target: our own measure
    rnd.stored(0, 0.03, completer=1)  # a peer completed it, without a mark: room for one
    more = rnd.due(0.03)
    assert [t.segment for t in more] == [6]
    assert all(t.header.flags & Flags.QUEUED for t in more)


def _answered(rnd: AllreduceRound, t: Transmit, completer: int) -> tuple[bytearray, int]:
    """The RESULT of transmission `t` as its core sends it, completed by `completer`."""
    h = t.header._replace(kind=Kind.RESULT, flags=Flags.NONE, rank=completer)
    buf = bytearray(HEADER_SIZE + h.length)
    pack_into(buf, h)
    return buf, len(buf)


def test_a_delay_sample_ends_when_the_result_reached_this_host_not_when_it_was_read() -> None:
    """A result that sat in this host's socket (our process not running: a GC pause, a busy
    GIL) found no queue on the path: the sample ends at the kernel's receive time. The same
    results read as late with no such time cut the window."""
    def cuts(arrival_known: bool) -> int:
        endpoint = (Endpoint(("a", 0), 1, 99, 8, "appliance core 0"),)
        window = CongestionWindow([8], POLICY)
        rnd = AllreduceRound(endpoint, 0, 2, 1, DType.FLOAT32, Op.SUM, 16 * 64, 64,
                             RttEstimator(Timing()), 0.0, window=window)
        out = memoryview(bytearray(16 * 64))
        for turn, t in enumerate(rnd.due(0.0)[:3]):  # one result per receive turn
            buf, n = _answered(rnd, t, completer=0)  # ours completed it: a delay sample
            now = 0.1 + turn * 0.01  # read 100 ms after it left: over the 20 ms target
            arrived = 0.005 + turn * 0.01 if arrival_known else None  # there after 5 ms
            assert rnd.take_results(buf, memoryview(buf), 0, n, n, ("a", 0), now, out,
                                    arrived) == n
        return window.cuts
    assert cuts(arrival_known=True) == 0
    assert cuts(arrival_known=False) == 1


def test_the_window_that_fits_a_receive_buffer() -> None:
    """A worker that is not root gets 416 KiB on a stock kernel (rmem_max 212992, doubled):
    43 coalesced results of 8972 bytes as the kernel charges them, 21 a core over two cores
    (31 and 15 one datagram per receive); a tuned host's 64 MiB holds every slot; a tiny
    buffer still leaves the least window."""
    assert fitting_window(425984, 8972, 2) == 21
    assert fitting_window(425984, 8972, 1) == 43
    assert fitting_window(425984, 8972, 2, coalesced=False) == 15
    assert fitting_window(64 << 20, 8972, 8) >= 32
    assert fitting_window(4096, 8972, 2) == Congestion.min_window


def test_a_window_held_below_the_slots_gates_from_the_start_and_never_grows_past_it() -> None:
    w = CongestionWindow([15, 15], POLICY, slots=[32, 32])
    assert w.limit == [15, 15] and w.shrunk  # the gate applies before any cut
    for _ in range(200):
        w.on_answer(0)
    assert w.limit == [15, 15] and w.shrunk
    fixed = CongestionWindow([15], Congestion(enabled=False), slots=[32])
    fixed.on_delay(0, 10.0, now=1.0)
    assert fixed.limit == [15] and fixed.shrunk


def test_a_round_keeps_no_more_than_the_held_window_in_flight() -> None:
    """Fixed windows (the appliance advises no queue target), held to 3 of 8 slots by a small
    receive buffer: a round sends three segments, then one per result."""
    endpoint = (Endpoint(("a", 0), 1, 99, 8, "appliance core 0"),)
    window = CongestionWindow([3], Congestion(enabled=False), slots=[8])
    rnd = AllreduceRound(endpoint, 0, 2, 1, DType.FLOAT32, Op.SUM, 16 * 64, 64,
                         RttEstimator(Timing()), 0.0, window=window)
    assert [t.segment for t in rnd.due(0.0)] == [0, 1, 2]
    assert rnd.due(0.0) == [] and rnd.wakeup() > 0.0
    rnd.stored(0, 0.01, completer=1)
    assert [t.segment for t in rnd.due(0.01)] == [3]
