"""Worker sessions against real aggregators over an in-memory lossy network, simulated time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reduction_appliance.dataplane.errors import AllreduceTimeout, JobAborted
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.wire import DType, Flags, Kind, Op
from reduction_appliance.deploy.testnet.reference import (
    integer_valued,
    random_values,
    reference,
    same_bits,
)
from reduction_appliance.plugin.rtt import RttEstimator, Timing
from reduction_appliance.plugin.serials import ResultSerials
from reduction_appliance.plugin.session import (
    FAST_RETRANSMIT,
    REORDER_SHARE,
    AllreduceRound,
    Endpoint,
    Repairs,
    Transmit,
)

from .simnet import Faults, SimNet

KERNELS = select_kernels()


def endpoints(n: int = 2, slots: int = 2) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(("a", i), 1, 99, slots, f"appliance core {i}") for i in range(n))


def test_window_releases_a_slot_only_after_its_result() -> None:
    rnd = AllreduceRound(endpoints(2, 2), 0, 2, 1, DType.FLOAT32, Op.SUM, 10 * 64, 64,
                         RttEstimator(), 0.0)
    first = rnd.due(0.0)
    assert [t.segment for t in first] == [0, 1, 2, 3]  # 2 endpoints x 2 slots
    assert [(t.endpoint, t.header.slot) for t in first] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert rnd.due(0.001) == []
    h = first[2].header._replace(kind=Kind.RESULT)
    assert rnd.accept(h) == 2
    rnd.stored(2, 0.002)
    (nxt,) = rnd.due(0.002)
    assert (nxt.segment, nxt.endpoint, nxt.header.slot) == (6, 0, 1)
    assert rnd.accept(h) is None  # a duplicate result is not wanted twice


def test_a_result_that_waited_for_a_repair_is_no_round_trip_sample() -> None:
    """A RESULT flagged REPAIRED (its completing contribution was sent again, or sent late
    after a repair: wire.py) held a repair in its round trip: no sample. An unflagged one on
    the other core is, QUEUED or not."""
    rtt = RttEstimator()
    rnd = AllreduceRound(endpoints(2, 2), 0, 2, 1, DType.FLOAT32, Op.SUM, 4 * 64, 64, rtt, 0.0)
    sent = rnd.due(0.0)
    for t, flags in zip(sent, (Flags.REPAIRED, Flags.QUEUED, Flags.REPAIRED | Flags.QUEUED,
                               Flags.NONE), strict=True):
        k = rnd.accept(t.header._replace(kind=Kind.RESULT))
        assert k is not None
        rnd.stored(k, 0.004, 1, flags)
    assert rnd.done
    assert rtt.srtt(0) is None  # both of core 0's results were repaired
    assert rtt.srtt(1) == pytest.approx(0.004)


def queried_at(rnd: AllreduceRound, segment: int, times: int) -> list[float]:
    """When `segment` asks, over the round's first `times` queries of it, no core answering."""
    asked: list[float] = []
    while len(asked) < times:
        now = rnd.wakeup()
        for t in rnd.due(now):
            if t.segment == segment:
                # a retransmission, and a probe: nothing came back from the core since it left
                assert t.header.flags == Flags.RETRANSMIT | Flags.PROBE | Flags.SENT
                asked.append(round(now, 3))
    return asked


def test_unanswered_segments_are_retransmitted_with_backoff() -> None:
    timing = Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.4, deadline=5.0)
    rnd = AllreduceRound(endpoints(1, 32), 0, 2, 1, DType.FLOAT32, Op.SUM, 32 * 64, 64,
                         RttEstimator(timing), 0.0)
    assert len(rnd.due(0.0)) == 32
    # 0.1, 0.2, 0.4, then capped at rto_max (32 in flight x silent_query_gap is more)
    assert queried_at(rnd, 0, 4) == [0.1, 0.3, 0.7, 1.1]


def test_a_silent_cores_last_segments_are_asked_after_every_query_gap() -> None:
    """At a round's tail a lost answer is likelier than a dead core: a lone segment's timer
    backs off no further than `silent_query_gap` per segment in flight."""
    timing = Timing(rto_initial=0.01, rto_min=0.01, rto_max=0.4, deadline=5.0,
                    silent_query_gap=0.025)
    for in_flight, waits in ((1, [0.01, 0.02, 0.025, 0.025]), (2, [0.01, 0.02, 0.04, 0.05])):
        rnd = AllreduceRound(endpoints(1, in_flight), 0, 2, 1, DType.FLOAT32, Op.SUM,
                             in_flight * 64, 64, RttEstimator(timing), 0.0)
        assert len(rnd.due(0.0)) == in_flight
        asked = queried_at(rnd, 0, 4)
        assert [round(b - a, 3) for a, b in zip([0.0, *asked[:-1]], asked, strict=True)] == waits


def test_a_window_of_alike_samples_does_not_collapse_the_timer() -> None:
    """Neighbouring segments' round trips are alike: with a window of 32 in flight, 32 short
    ones in a row are one round trip's worth of evidence, not four RTOs' worth. Scaled gains
    keep the timer above the long round trips seen a moment before; RFC 6298's per-sample
    gains would have let it fall to about the short ones."""
    estimator = RttEstimator(Timing(rto_min=0.001))
    for burst in range(20):  # bursts of short and long round trips, 32 samples each
        for rtt in (0.005, 0.015):
            for _ in range(32):
                estimator.sample(0, rtt, 32)
                if burst:  # from the second burst on, when both kinds were seen
                    assert estimator.rto(0) > 0.015
    lone = RttEstimator(Timing(rto_min=0.001))
    lone.sample(0, 0.015)
    for _ in range(32):
        lone.sample(0, 0.005, 1)  # one sample per round trip: the gains as RFC 6298 has them
    assert lone.rto(0) < 0.01


def test_a_round_samples_with_its_window_in_flight() -> None:
    """Results of one round trip move the estimate as one sample would, not as 16 would."""
    estimator = RttEstimator(Timing(rto_min=0.001))
    estimator.sample(0, 0.010)
    rnd = AllreduceRound(endpoints(1, 32), 0, 2, 1, DType.FLOAT32, Op.SUM, 32 * 64, 64,
                         estimator, 0.0)
    sent = rnd.due(0.0)
    assert len(sent) == 32
    for t in sent[:16]:
        assert rnd.accept(t.header._replace(kind=Kind.RESULT)) == t.segment
        rnd.stored(t.segment, 0.001)
    srtt = estimator.srtt(0)
    assert srtt is not None and 0.008 < srtt < 0.010


def one_segment(timing: Timing, rtt: float | None = None) -> tuple[AllreduceRound, Transmit]:
    """Rank 0 of 2, one segment, one core (with a round trip of `rtt` measured); sent at t=0."""
    estimator = RttEstimator(timing)
    if rtt is not None:
        estimator.sample(0, rtt)
    rnd = AllreduceRound(endpoints(1, 1), 0, 2, 1, DType.FLOAT32, Op.SUM, 64, 64, estimator, 0.0)
    (sent,) = rnd.due(0.0)
    assert sent.header.kind is Kind.CONTRIBUTION
    return rnd, sent


def test_retransmissions_are_queries_until_the_core_says_ours_never_came() -> None:
    rnd, _ = one_segment(Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.4, deadline=5.0))
    (first,) = rnd.due(rnd.wakeup())
    assert first.header.kind is Kind.QUERY and first.header.length == 64  # the segment's
    # The core answers our query: nothing of ours came. Resent at once, with its payload.
    rnd.on_pending(first.header._replace(kind=Kind.PENDING), bytes([0b10]), 0.105)
    assert rnd.wakeup() == 0.0
    (resent,) = rnd.due(0.105)
    assert resent.header.kind is Kind.CONTRIBUTION and resent.header.flags & Flags.RETRANSMIT
    (later,) = rnd.due(rnd.wakeup())
    assert later.header.kind is Kind.QUERY  # the payload went once; ask again
    assert (rnd.nudged_retransmissions, rnd.queries, rnd.retransmissions) == (1, 2, 3)
    # two timers ran out (both asked), one PENDING told us ours never came (the payload)
    assert rnd.repairs == Repairs(overtaken=0, told=1, timer=2, queries=2)
    assert rnd.repairs.total == rnd.retransmissions


def test_a_pending_for_a_peer_nudges_only_once_ours_had_time_to_arrive() -> None:
    rnd, sent = one_segment(Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.4, deadline=5.0),
                            rtt=0.02)  # so the retransmission timer is 0.02 + 4 x 0.01
    peers = sent.header._replace(kind=Kind.PENDING, rank=1)  # rank 1 queried
    rnd.on_pending(peers, bytes([0b10]), 0.01)  # ours may still be on its way
    assert rnd.due(0.01) == []
    rnd.on_pending(peers._replace(use=sent.header.use + 1), bytes([0b10]), 0.03)  # not our use
    assert rnd.due(0.03) == []
    rnd.on_pending(peers, bytes([0b01]), 0.03)  # ours is in
    assert rnd.due(0.03) == []
    rnd.on_pending(peers, bytes([0b10]), 0.03)  # a round trip on, still not there: lost
    (resent,) = rnd.due(0.03)
    assert resent.header.kind is Kind.CONTRIBUTION and rnd.nudged_retransmissions == 1


@pytest.mark.parametrize("repaired", [False, True])
def test_a_core_waiting_for_a_late_rank_is_asked_with_backoff_unless_a_loss_was_repaired(
        repaired: bool) -> None:
    """A PENDING that has ours says the core waits for a late rank: in a clean round the
    segment backs off as from a silent core (a rank paused for seconds drew a query per RTO
    per segment from every rank waiting for it). Once the round repaired a loss, the late rank
    may be repairing one too: the next query goes at the RTO, as for any answer."""
    rnd, sent = one_segment(Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.8, deadline=5.0,
                                   silent_query_gap=1.0))
    if repaired:  # our own query's PENDING lacks us: resent with its payload at once
        rnd.on_pending(sent.header._replace(kind=Kind.PENDING), bytes([0b10]), 0.05)
        (again,) = rnd.due(0.05)
        assert again.header.kind is Kind.CONTRIBUTION and rnd.nudged_retransmissions == 1
    times = []
    for answered in (False, True, False, False, False):
        now = rnd.wakeup()
        (t,) = rnd.due(now)
        times.append(round(now, 3))
        if answered:  # ours is in; the segment waits for rank 1
            rnd.on_pending(t.header._replace(kind=Kind.PENDING), bytes([0b01]), now + 0.01)
    if repaired:
        # 0.1 after the resend (the PENDING at 0.05 was an answer), doubled to 0.2; the core
        # answered the 0.25 query, so the wait after the next is the base 0.1; then doubled.
        assert times == [0.15, 0.25, 0.45, 0.55, 0.75]
    else:
        # Waits of 0.1, doubled to 0.2 and 0.4; the core answered the 0.3 query with a
        # PENDING: still doubling, up to rto_max.
        assert times == [0.1, 0.3, 0.7, 1.5, 2.3]


def stalled_window() -> tuple[AllreduceRound, list[Transmit]]:
    """Rank 0 of 2, one core with 4 slots, 8 segments, an RTO of 0.1 whatever the samples;
    the first 4 segments sent at t=0."""
    timing = Timing(rto_initial=0.1, rto_min=0.1, rto_max=0.1, deadline=5.0)
    rnd = AllreduceRound(endpoints(1, 4), 0, 2, 1, DType.FLOAT32, Op.SUM, 8 * 64, 64,
                         RttEstimator(timing), 0.0)
    sent = rnd.due(0.0)
    assert [t.segment for t in sent] == [0, 1, 2, 3]
    return rnd, sent


def answer(rnd: AllreduceRound, t: Transmit, now: float, serial: int = 0) -> None:
    assert rnd.accept(t.header._replace(kind=Kind.RESULT, serial=serial)) == t.segment
    rnd.stored(t.segment, now)


def test_first_transmissions_of_one_call_to_a_core_share_one_timer_entry() -> None:
    """One heap entry for a call's first transmissions to a core (they share their timeout):
    it stands while any of them is unanswered with that timer, and goes with the last."""
    rnd, sent = stalled_window()
    assert len(rnd._timers) == 1
    for t in sent[:3]:
        answer(rnd, t, 0.01)
    assert rnd.next_timer() == pytest.approx(0.1)  # segment 3's, still waiting
    answer(rnd, sent[3], 0.02)
    assert rnd.next_timer() == math.inf and rnd._timers == []
    released = rnd.due(0.02)  # segments 4-7, their slots free again: one entry again
    assert [t.segment for t in released] == [4, 5, 6, 7] and len(rnd._timers) == 1
    # All four run out together, taken in segment order: the lowest asks for the stalled
    # core, the others wait for its answer (plugin/expiry.py).
    assert [t.segment for t in rnd.due(0.2)] == [4]
    assert rnd.next_timer() == pytest.approx(0.2 + 0.1)


def test_a_segment_waiting_its_turn_behind_answered_ones_is_not_queried() -> None:
    """Results come back in order while the core waits for a late rank: each answer restarts
    the timers of the segments behind it, and only a core silent for a whole RTO is asked."""
    rnd, sent = stalled_window()
    answer(rnd, sent[0], 0.09)
    assert [t.segment for t in rnd.due(0.09)] == [4]  # the slot's next segment
    assert rnd.due(0.1) == []  # 1, 2, 3's timers ran out, but 0 was answered after they left
    answer(rnd, sent[1], 0.15)
    assert [t.segment for t in rnd.due(0.15)] == [5]
    assert rnd.wakeup() == pytest.approx(0.19) and rnd.due(0.19) == []  # 1 answered at 0.15
    # 0.1 of silence: the core is stalled, and one query asks for all of it (the oldest).
    (query,) = rnd.due(0.25)
    assert query.segment == 2 and query.header.kind is Kind.QUERY
    # A stall, not a hole (nothing sent after it was answered): a PROBE, which the appliance
    # answers with PENDING while the result has only just left.
    assert query.header.flags == Flags.RETRANSMIT | Flags.PROBE | Flags.SERIAL | Flags.SENT
    assert query.note == bytes([5])  # the newest number sent to the core: segment 5's
    # No PENDING came back within an RTO (the answer was lost, or a result is): every
    # unanswered segment asks, as in a lossy round.
    queries = rnd.due(0.35)
    assert sorted(t.segment for t in queries) == [2, 3, 4, 5] and rnd.retransmissions == 5


def test_a_stalled_core_that_answers_pending_is_asked_one_query_at_a_time() -> None:
    """At n = 8 on two shared CPUs a late rank stalls every segment in flight at once; each
    one's own query would cost a PENDING (or a resent result) apiece."""
    rnd, _ = stalled_window()
    (first,) = rnd.due(0.1)
    assert first.segment == 0 and rnd.wakeup() == pytest.approx(0.2)
    assert rnd.due(0.15) == []
    late = first.header._replace(kind=Kind.PENDING, rank=0)
    rnd.on_pending(late, bytes([0b01]), 0.15)  # ours is in: the core waits for rank 1
    (second,) = rnd.due(0.2)  # the next one goes alone
    assert second.segment == 0 and rnd.retransmissions == 2  # its own timer came first
    assert rnd.due(0.25) == []
    # A round that repaired a loss asks at every timer again.
    rnd.missing(3)
    assert [t.segment for t in rnd.due(0.26)] == [3]
    assert len(rnd.due(0.31)) >= 2


def test_a_segment_whose_timer_ran_out_behind_a_stall_query_gives_no_rtt_sample() -> None:
    """Its answer, however late, measures the wait for a late rank, not the path: a sample of
    it would stretch every later timer of the core (a whole second on the rack)."""
    rnd, sent = stalled_window()
    (_,) = rnd.due(0.1)  # segment 0 asks; 1, 2, 3 wait for its answer
    answer(rnd, sent[1], 0.9)
    assert rnd._rtt.srtt(0) is None
    fresh = [t for t in rnd.due(0.9) if t.header.kind is Kind.CONTRIBUTION]
    answer(rnd, fresh[0], 0.92)  # a first transmission answered in time: sampled
    assert rnd._rtt.srtt(0) == pytest.approx(0.02)


def test_a_hole_is_queried_at_its_own_timer() -> None:
    """An answer to a segment sent after k means k was lost: no waiting for its turn."""
    rnd, sent = stalled_window()
    answer(rnd, sent[1], 0.05)
    rnd.due(0.05)  # segment 5 goes out
    (query,) = [t for t in rnd.due(0.1) if t.segment == 0]
    assert query.header.kind is Kind.QUERY
    assert query.header.flags == Flags.RETRANSMIT | Flags.SERIAL | Flags.SENT  # not a PROBE


def test_three_later_answers_repair_a_hole_at_once_with_a_plain_query() -> None:
    """Fast retransmit: once FAST_RETRANSMIT segments sent after k are answered, k is asked
    after at once, long before its timer, and not as a PROBE: the hole is certain."""
    rnd, sent = stalled_window()
    for n, t in enumerate(sent[1:FAST_RETRANSMIT + 1]):
        answer(rnd, t, 0.01 * (n + 1))
        released = rnd.due(0.01 * (n + 1))
    (query,) = [t for t in released if t.segment == 0]
    assert query.header.kind is Kind.QUERY
    assert query.header.flags == Flags.RETRANSMIT | Flags.SERIAL | Flags.SENT
    assert rnd.fast_retransmissions == 1
    assert rnd.repairs == Repairs(overtaken=1, told=0, timer=0, queries=1)


def test_an_overtaken_segment_gets_time_to_arrive_before_it_is_presumed_lost() -> None:
    """A segment completes when its last rank is in, so later ones overtaking it is usual
    (a peer repairing a loss sends its part late): it is presumed lost only once it has also
    been gone two smoothed round trips (REORDER_SHARE), and `wakeup` says when that is. One
    that arrives before then is never asked after."""
    rnd, sent = stalled_window()
    for t, at in zip(sent[1:4], (0.020, 0.021, 0.022), strict=True):
        answer(rnd, t, at)
    assert [t.segment for t in rnd.due(0.022)] == [5, 6, 7]  # released; 0 not presumed lost
    srtt = rnd._rtt.srtt(0)
    assert srtt is not None
    presumed = 0.0 + srtt * (1 + REORDER_SHARE)
    assert rnd.wakeup() == pytest.approx(presumed)
    assert rnd.due(presumed - 0.001) == []
    (query,) = rnd.due(presumed)
    assert query.segment == 0 and query.header.kind is Kind.QUERY
    assert rnd.fast_retransmissions == 1

    late, sent = stalled_window()
    for t, at in zip(sent[1:4], (0.020, 0.021, 0.022), strict=True):
        answer(late, t, at)
    late.due(0.022)
    answer(late, sent[0], 0.03)  # overtaken, not lost
    assert all(t.segment != 0 for t in late.due(presumed))
    assert late.fast_retransmissions == 0 and late.queries == 0


def test_an_overtaken_segment_is_asked_after_at_once_while_its_core_skipped_a_serial() -> None:
    """A core's results reach a worker in order, so a skipped serial is a result lost on its
    way: while one is missing, an overtaken segment may be the one it answered, and is asked
    after without the reordering wait. The resent result (its old serial) ends that."""
    rnd, sent = stalled_window()
    for t, serial, at in zip(sent[1:4], (0, 2, 3), (0.020, 0.021, 0.022), strict=True):
        answer(rnd, t, at, serial)  # serial 1 never came
    due = rnd.due(0.022)
    assert sorted(t.segment for t in due) == [0, 5, 6, 7]  # 0 asked after at once
    (query,) = [t for t in due if t.segment == 0]
    assert query.header.kind is Kind.QUERY and rnd.fast_retransmissions == 1
    answer(rnd, query, 0.03, 1)  # the lost result, resent
    assert rnd._serials.lost == [{}]

    # Without a skipped serial the same overtaken segment waits for the reordering window.
    calm, sent = stalled_window()
    for t, serial, at in zip(sent[1:4], (0, 1, 2), (0.020, 0.021, 0.022), strict=True):
        answer(calm, t, at, serial)
    assert all(t.segment != 0 for t in calm.due(0.022))


def test_as_many_overtaken_segments_are_asked_after_at_once_as_results_were_lost() -> None:
    """One skipped serial is one lost result, which answered one segment, most likely the
    oldest overtaken: that one is asked after at once, and while it is unanswered, another
    overtaken segment waits the reordering window, as on a core that lost nothing (it waits
    on a peer's repair as often). Asking after every overtaken segment at once, at 1% loss
    each way, made most such queries find their result complete and on its way."""
    rnd, sent = stalled_window()
    answer(rnd, sent[2], 0.020, 0)
    answer(rnd, sent[3], 0.021, 2)  # serial 1 never came
    due = rnd.due(0.021)  # 0 is overtaken: asked after at once; 6 and 7 take the free slots
    assert [(t.segment, t.header.kind) for t in due] == [
        (0, Kind.QUERY), (6, Kind.CONTRIBUTION), (7, Kind.CONTRIBUTION)]
    answer(rnd, due[1], 0.030, 3)  # now 1 is overtaken too
    assert rnd.due(0.030) == []
    srtt = rnd._rtt.srtt(0)
    assert srtt is not None
    presumed = 0.0 + srtt * (1 + REORDER_SHARE)
    assert presumed > 0.030 and rnd.wakeup() == pytest.approx(presumed)
    (query,) = rnd.due(presumed)  # 1 after the window, as if nothing were lost
    assert query.segment == 1 and query.header.kind is Kind.QUERY
    assert rnd.repairs == Repairs(overtaken=2, told=0, timer=0, queries=2)

    # Two results lost: the second overtaken segment is asked after at once too.
    rnd, sent = stalled_window()
    answer(rnd, sent[2], 0.020, 0)
    answer(rnd, sent[3], 0.021, 3)  # serials 1 and 2 never came
    due = rnd.due(0.021)
    answer(rnd, due[1], 0.030, 4)
    assert [(t.segment, t.header.kind) for t in rnd.due(0.030)] == [(1, Kind.QUERY)]


def test_skipped_result_serials_are_kept_across_the_wrap_until_they_come_or_grow_stale() -> None:
    serials = ResultSerials(1)
    serials.jump(0, 254)  # the first heard: nothing skipped
    assert serials.newest == [254] and serials.lost == [{}]
    serials.jump(0, 1)  # 255 and 0 skipped, across the wrap
    assert serials.newest == [1] and sorted(serials.lost[0]) == [0, 255]
    serials.jump(0, 255)  # a lost one came again; the newest stays
    assert serials.newest == [1] and sorted(serials.lost[0]) == [0]
    serials.jump(0, 100)
    serials.jump(0, 200)  # 0 is now more than half the serials behind: forgotten
    assert 0 not in serials.lost[0] and 73 in serials.lost[0] and 72 not in serials.lost[0]
    serials.reset()
    assert serials.newest == [-1] and serials.lost == [{}]


def test_a_query_carries_the_newest_result_serial_heard_from_its_core() -> None:
    """The appliance resends a result only to a worker that has a later one (wire.Flags.SERIAL):
    the query names the newest serial heard from that core, in the serials' wrapping order, and
    a resent (older) result does not move it back. Before any result, no serial is claimed."""
    rnd, sent = stalled_window()
    assert all(not t.header.flags & Flags.SERIAL for t in rnd.due(0.1))  # nothing heard yet
    for t, serial, at in ((sent[1], 254, 0.11), (sent[2], 255, 0.12), (sent[3], 0, 0.13)):
        answer(rnd, t, at, serial)
    due = rnd.due(0.13)
    (query,) = [t for t in due if t.segment == 0]  # fast retransmit: 3 later ones answered
    assert query.header.flags & Flags.SERIAL and query.header.serial == 0  # 0 came after 255
    answer(rnd, next(t for t in due if t.segment == 5), 0.14, 253)  # e.g. a resent result
    (again,) = [t for t in rnd.due(1.0) if t.segment == 0]
    assert again.header.flags & Flags.SERIAL and again.header.serial == 0


def test_a_round_that_repaired_a_loss_queries_at_each_timer() -> None:
    """Once a round has repaired a loss, answers to earlier segments no longer hold the
    timers back: repairs never queue behind one another."""
    rnd, sent = stalled_window()
    rnd.on_pending(sent[3].header._replace(kind=Kind.PENDING), bytes([0b10]), 0.02)
    (nudged,) = rnd.due(0.02)  # the core said ours never came: resent with its payload
    assert nudged.segment == 3 and nudged.header.kind is Kind.CONTRIBUTION
    answer(rnd, sent[0], 0.09)
    rnd.due(0.09)
    queries = rnd.due(0.1)
    assert sorted(t.segment for t in queries) == [1, 2]
    # Plain queries, not PROBEs: in a round that repaired a loss, a stall may be a repair.
    assert all(t.header.flags == Flags.RETRANSMIT | Flags.SERIAL | Flags.SENT for t in queries)


def test_deadline_raises_naming_silent_cores_and_missing_ranks() -> None:
    timing = Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.4, deadline=2.0)
    rnd = AllreduceRound(endpoints(2, 1), 1, 4, 3, DType.FLOAT16, Op.AVG, 256, 64,
                         RttEstimator(timing), 0.0)
    sent = rnd.due(0.0)
    rnd.stored(rnd.accept(sent[1].header._replace(kind=Kind.RESULT)) or 0, 0.01)
    pending = sent[0].header._replace(kind=Kind.PENDING)
    rnd.on_pending(pending, bytes([0b0110]), 0.02)
    with pytest.raises(AllreduceTimeout) as err:
        while True:
            rnd.due(rnd.wakeup())
    text = str(err.value)
    assert "appliance core 0" in text and "ranks [0, 3]" in text
    assert "appliance core 1 (" in text and "round 3" in text and "rank 1" in text


def test_the_deadline_counts_from_the_last_result_not_from_the_start() -> None:
    """A round that keeps getting results goes on past its deadline (a 1.6 GB all_reduce at a
    0.5 s deadline once failed after 0.5 s, 19757 of 24462 segments to go, its results still
    coming); one that stops getting them fails its deadline after the last."""
    timing = Timing(rto_initial=0.1, rto_min=0.1, rto_max=0.1, deadline=1.0)
    rnd = AllreduceRound(endpoints(1, 4), 0, 2, 1, DType.FLOAT32, Op.SUM, 8 * 64, 64,
                         RttEstimator(timing), 0.0)
    sent = {t.segment: t for t in rnd.due(0.0)}
    now = 0.0
    for k in range(6):  # a result every 0.5 s: 3 s in all, three deadlines
        now += 0.5
        answer(rnd, sent[k], now)
        sent.update((t.segment, t) for t in rnd.due(now) if t.header.kind is Kind.CONTRIBUTION)
    last = now
    with pytest.raises(AllreduceTimeout, match=r"had no result for its deadline, 1 s \(4\.0 s"):
        while True:
            now = rnd.wakeup()
            rnd.due(now)
    assert now == pytest.approx(last + 1.0)


@pytest.mark.parametrize("slots", [32, 4])  # 4 segments of each rank per core: crowded at 4
def test_ranks_waiting_for_a_late_rank_ask_no_more_than_one_query_per_gap(slots: int) -> None:
    """Rank 3 starts 3 s after the others (a checkpoint, a paused process): each rank waiting
    for it asked after every segment in flight once per RTO, 2392 queries apiece here (600
    with 4 slots, where one stall query at a time asks for a crowded core; one rank's 64 KiB
    allreduce on the emulated rack: 780 a second), each answered by a PENDING. Now no more
    than one per `silent_query_gap` per core (256), or at doubling gaps (66), and the result
    is exact and as prompt."""
    timing = Timing()  # the product's: RTO at least 10 ms, one query per 25 ms once backed off
    # No reordering: a result's MISSING for a reordered datagram would make the round one that
    # repaired a loss, whose queries go at the RTO whatever the core says (see above).
    net = SimNet(KERNELS, world=4, slots=slots, timing=timing, faults=Faults(max_delay=0.0))
    rng = np.random.default_rng(3)
    try:
        xs = [integer_valued(rng, 8 * 256 // 4, DType.FLOAT32) for _ in range(4)]
        net.allreduce([x.copy() for x in xs], DType.FLOAT32, Op.SUM)  # RTTs sampled: 10 ms
        arrays = [x.copy() for x in xs]
        started = net.now
        rounds = net.allreduce(arrays, DType.FLOAT32, Op.SUM, late={3: 3.0})
        for a in arrays:
            assert same_bits(a, reference(xs, Op.SUM))
        assert net.now - started < 3.0 + 0.05  # the result came as soon as rank 3 did
        ceiling = net.cores * 3.0 / timing.silent_query_gap + 8 * 8  # + the backing off
        for rnd in rounds[:3]:
            assert 0 < rnd.retransmissions <= ceiling
        assert rounds[3].retransmissions == 0
    finally:
        net.close()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", list(DType))
def test_clean_network_all_ops(dtype: DType, deterministic: bool) -> None:
    net = SimNet(KERNELS, world=4, deterministic=deterministic)
    rng = np.random.default_rng(int(dtype))
    try:
        for op in Op:
            make = random_values if deterministic else integer_valued
            xs = [make(rng, 1000, dtype) for _ in range(4)]
            want = reference(xs, op)
            arrays = [x.copy() for x in xs]
            net.allreduce(arrays, dtype, op)
            for a in arrays:
                assert same_bits(a, want)
    finally:
        net.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(1, 6),
    cores=st.integers(1, 3),
    slots=st.integers(1, 4),
    elements=st.integers(1, 700),
    drop=st.sampled_from([0.0, 0.05, 0.2, 0.4]),
    duplicate=st.sampled_from([0.0, 0.1, 0.5]),
    max_delay=st.sampled_from([0.0, 0.002, 0.05]),
    deterministic=st.booleans(),
    multicast=st.booleans(),
    dtype=st.sampled_from(list(DType)),
    op=st.sampled_from(list(Op)),
    seed=st.integers(0, 2**32 - 1),
)
def test_lossy_network_is_always_exact(
    world: int, cores: int, slots: int, elements: int, drop: float, duplicate: float,
    max_delay: float, deterministic: bool, multicast: bool, dtype: DType, op: Op, seed: int,
) -> None:
    net = SimNet(KERNELS, world=world, cores=cores, slots=slots, deterministic=deterministic,
                 multicast=multicast, faults=Faults(drop, duplicate, max_delay, seed))
    rng = np.random.default_rng(seed)
    try:
        for _ in range(2):  # two rounds: slots are reused across rounds
            make = random_values if deterministic else integer_valued
            xs = [make(rng, elements, dtype) for _ in range(world)]
            want = reference(xs, op)
            arrays = [x.copy() for x in xs]
            order = list(rng.permutation(world))
            net.allreduce(arrays, dtype, op, order=order)
            for a in arrays:
                assert same_bits(a, want)
        for agg in net.aggregators:  # no receive buffer leaked by held contributions
            stats = agg.stats(7, net.now)
            assert stats is not None and stats.waiting == {}
    finally:
        net.close()


def test_an_abort_notice_fails_the_round_at_once() -> None:
    rnd = AllreduceRound(endpoints(2, 1), 0, 2, 1, DType.FLOAT32, Op.SUM, 256, 64,
                         RttEstimator(), 0.0)
    sent = rnd.due(0.0)
    rnd.on_aborted(sent[0].header._replace(kind=Kind.ABORTED, cookie=1234))  # not ours
    rnd.due(0.001)
    rnd.on_aborted(sent[0].header._replace(kind=Kind.ABORTED))  # an older appliance: no reason
    with pytest.raises(JobAborted, match=r"aborted job 1 \(an operator abort, idle eviction or "):
        rnd.due(0.002)


def test_an_rto_follows_every_sample_and_a_change_of_bounds() -> None:
    # A worker asks each core's RTO every turn and the estimator keeps the answer between
    # samples: a sample, or new bounds (a caller may swap `timing`), must show at once.
    rtt = RttEstimator(Timing(rto_initial=0.05, rto_min=0.01, rto_max=1.0))
    assert rtt.rto(0) == 0.05  # before any sample
    rtt.sample(0, 0.1)
    assert rtt.rto(0) == pytest.approx(0.1 + 4 * 0.05)  # RFC 6298's first: srtt + 4 x rtt/2
    rtt.sample(0, 0.1)
    assert rtt.rto(0) == pytest.approx(0.1 + 4 * 0.0375)
    assert rtt.rto(1) == 0.05  # another core has its own
    rtt.timing = Timing(rto_initial=0.05, rto_min=0.5, rto_max=1.0)
    assert rtt.rto(0) == 0.5  # the new floor
