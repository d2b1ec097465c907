"""Congestion control of the worker session: the AIMD window per appliance core, the rule that
keeps windows of different ranks from deadlocking, and one probe per silent core."""

from __future__ import annotations

import numpy as np
import pytest

from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.wire import DType, Kind, Op
from reduction_appliance.deploy.testnet.reference import integer_valued, reference, same_bits
from reduction_appliance.plugin.session import (
    MIN_WINDOW,
    AllreduceRound,
    Endpoint,
    RttEstimator,
    Timing,
    Transmit,
)

from .simnet import Faults, SimNet

KERNELS = select_kernels("numpy")


def endpoint(slots: int) -> tuple[Endpoint, ...]:
    return (Endpoint(("a", 0), 1, 99, slots, "appliance core 0"),)


def test_the_window_is_the_slot_count_until_a_loss_then_aimd() -> None:
    est = RttEstimator(Timing(rto_min=0.01))
    assert est.window(0, 32) == 32  # a clean network runs as without congestion control
    est.sample(0, 0.002)
    est.on_loss(0, 32, now=1.0)
    assert est.window(0, 32) == 16
    est.on_loss(0, 32, now=1.001)  # the same burst's losses, within a round trip: one cut
    assert est.window(0, 32) == 16
    est.on_loss(0, 32, now=1.01)
    assert est.window(0, 32) == 8 and est.window_cuts == 2
    for _ in range(9):  # about a window of results: one more
        est.on_result(0, 32)
    assert est.window(0, 32) == 9
    for _ in range(10_000):
        est.on_result(0, 32)
    assert est.window(0, 32) == 32  # never above the slots
    for i in range(20):
        est.on_loss(0, 32, now=2.0 + i)
    assert est.window(0, 32) == MIN_WINDOW  # never below the floor
    assert est.window(0, 1) == 1  # nor above a core with fewer slots


def _answer(rnd: AllreduceRound, sent: list[Transmit], *segments: int) -> None:
    by_segment = {t.segment: t for t in sent}
    for k in segments:
        rnd.stored(rnd.accept(by_segment[k].header._replace(kind=Kind.RESULT)) or 0, 10.0)


def test_a_cut_window_holds_later_segments_but_never_the_lowest_unanswered() -> None:
    est = RttEstimator(Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.4, deadline=5.0))
    est.on_loss(0, 4, now=0.0)  # cut to 2 of the 4 slots
    rnd = AllreduceRound(endpoint(4), 0, 2, 1, DType.FLOAT32, Op.SUM, 12 * 64, 64, est, 10.0)
    sent = rnd.due(10.0)
    assert [t.segment for t in sent] == [0, 1]  # a window of 2 of the 4 free slots
    assert rnd.due(10.0) == [] and rnd.wakeup() > 10.0  # full: nothing to do until a result
    _answer(rnd, sent, 1)  # frees a window place (and slot 1, for segment 5): 2 goes, not 5
    sent += rnd.due(10.0)
    assert [t.segment for t in sent[2:]] == [2]
    assert rnd.due(10.0) == []


def test_the_lowest_unanswered_segment_goes_beyond_the_window() -> None:
    # Windows of two ranks may hold different segments: whatever the core's oldest unfinished
    # segment waits for must always go, or each rank could wait for another's (deadlock).
    est = RttEstimator(Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.4, deadline=5.0))
    rnd = AllreduceRound(endpoint(4), 0, 2, 1, DType.FLOAT32, Op.SUM, 12 * 64, 64, est, 10.0)
    sent = rnd.due(10.0)
    assert [t.segment for t in sent] == [0, 1, 2, 3]  # the whole window: no loss yet
    _answer(rnd, sent, 1, 2)  # 0's result is late
    sent += rnd.due(10.0)
    assert [t.segment for t in sent[4:]] == [5, 6]
    est.on_loss(0, 4, now=10.0)  # cut to 2: in flight 0, 3, 5, 6
    _answer(rnd, sent, 3)  # releases 7, held by the window; 0 is presumed lost (fast retransmit)
    assert [(t.segment, t.header.kind) for t in rnd.due(10.0)] == [(0, Kind.QUERY)]
    _answer(rnd, sent, 0)  # frees slot 0 for segment 4, now the lowest without a result
    assert [t.segment for t in rnd.due(10.0)] == [4]  # in flight 5, 6, and 4: beyond 2
    assert rnd.due(10.0) == []  # 7 waits for the window


def test_a_silent_core_is_asked_by_one_probe_not_a_window_of_queries() -> None:
    est = RttEstimator(Timing(rto_initial=0.1, rto_min=0.01, rto_max=0.8, deadline=5.0))
    rnd = AllreduceRound(endpoint(4), 0, 2, 1, DType.FLOAT32, Op.SUM, 4 * 64, 64, est, 0.0)
    sent = rnd.due(0.0)
    assert len(sent) == 4
    (probe,) = rnd.due(0.1)  # every timer expired; the core has said nothing since
    assert probe.header.kind is Kind.QUERY and probe.segment == 0
    assert rnd.deferred == 3 and rnd.retransmissions == 1
    assert rnd.due(0.15) == []  # the others wait for the probe's answer
    # The core answers the probe: it has ours and waits for rank 1. The others are now asked
    # at their own timers (the core is alive: a missing one is a loss, not a silence).
    rnd.on_pending(probe.header._replace(kind=Kind.PENDING), bytes([0b01]), 0.15)
    later = rnd.due(0.31)
    assert sorted(t.segment for t in later) == [0, 1, 2, 3]  # the probe too, again
    assert all(t.header.kind is Kind.QUERY for t in later)


def _incast(net: SimNet, rounds: int) -> int:
    """Run `rounds` exact allreduces; return every rank's retransmissions."""
    rng = np.random.default_rng(7)
    total = 0
    for _ in range(rounds):
        xs = [integer_valued(rng, 4096, DType.FLOAT32) for _ in range(net.world)]
        want = reference(xs, Op.SUM)
        arrays = [x.copy() for x in xs]
        for rnd in net.allreduce(arrays, DType.FLOAT32, Op.SUM):
            total += rnd.retransmissions
        assert all(same_bits(a, want) for a in arrays)
    return total


def test_an_incast_shrinks_the_windows_instead_of_losing_a_window_each_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 ranks x 16 slots into a core whose queue holds 24 datagrams.
    def incast() -> SimNet:
        return SimNet(KERNELS, world=8, cores=1, slots=16, max_payload=256,
                      faults=Faults(max_delay=0.0, seed=3, bottleneck=(2e-5, 24)),
                      timing=Timing(0.01, 0.002, 0.2, 30.0))
    adaptive = incast()
    try:
        with_control = _incast(adaptive, 4)
        windows = [est.window(0, 16) for est in adaptive.rtts]
        drops_with = adaptive.queue_drops
    finally:
        adaptive.close()
    monkeypatch.setattr(RttEstimator, "on_loss", lambda *a: None)  # a fixed window, as before
    fixed = incast()
    try:
        without = _incast(fixed, 4)
        drops_without = fixed.queue_drops
    finally:
        fixed.close()
    print(f"incast, 8 ranks x 16 slots into a queue of 24: retransmissions {with_control} "
          f"(AIMD, final windows {windows}) vs {without} (fixed window); queue drops "
          f"{drops_with} vs {drops_without}")
    assert max(windows) < 16
    assert drops_with * 2 < drops_without
    assert with_control * 2 < without
