"""plugin.expiry: what an expired retransmission timer does, from what its core said lately."""

from __future__ import annotations

import pytest

from reduction_appliance.plugin.expiry import CoreSigns, Decision, Expiry
from reduction_appliance.plugin.rtt import Timing

TIMING = Timing(rto_initial=0.1, rto_min=0.01, rto_max=1.0, deadline=5.0,
                silent_query_gap=0.025)


def expire(signs: CoreSigns, now: float, *, stall: bool = False, crowded: bool = False,
           last_sent: float = 0.0, timeout: float = 0.1, in_flight: int = 64) -> Decision:
    return signs.on_expiry(0, now, stall=stall, crowded=crowded, last_sent=last_sent,
                           timeout=timeout, rto=0.1, in_flight=in_flight, timing=TIMING)


def test_a_silent_core_is_asked_with_a_doubled_timeout_capped_by_what_is_in_flight() -> None:
    signs = CoreSigns(1)
    assert expire(signs, 0.1) == Decision(Expiry.ASK, 0.2, False)
    assert expire(signs, 0.1, timeout=0.8) == Decision(Expiry.ASK, 1.0, False)  # rto_max
    # 8 in flight: no longer than 8 x 0.025 = 0.2; one: never below the core's RTO
    assert expire(signs, 0.1, timeout=0.8, in_flight=8).at == pytest.approx(0.2)
    assert expire(signs, 0.1, timeout=0.8, in_flight=1).at == pytest.approx(0.1)


def test_a_core_that_answered_since_the_segment_left_is_asked_at_its_rto() -> None:
    signs = CoreSigns(1)
    signs.heard_at[0] = 0.05
    assert expire(signs, 0.3, last_sent=0.05, timeout=0.4) == Decision(Expiry.ASK, 0.1, False)


def test_a_stalled_segment_waits_its_turn_while_earlier_ones_are_answered() -> None:
    signs = CoreSigns(1)
    signs.progress_at[0] = 0.08  # an earlier first transmission answered after ours left
    assert expire(signs, 0.1, stall=True, last_sent=0.05) == Decision(Expiry.RESTART, 0.18)
    # a whole RTO without progress: asked, as a PROBE
    assert expire(signs, 0.2, stall=True, last_sent=0.05) == Decision(Expiry.ASK, 0.2, True)


def test_a_crowded_stall_is_asked_about_by_one_query_at_a_time() -> None:
    signs = CoreSigns(1)
    first = expire(signs, 0.1, stall=True, crowded=True)
    assert first.expiry is Expiry.ASK and first.probe  # this one asks for all of them
    assert expire(signs, 0.15, stall=True, crowded=True) == Decision(Expiry.DEFER, 0.2)
    signs.heard_at[0] = signs.pending_at[0] = 0.18  # it heard a PENDING: the core waits
    assert expire(signs, 0.2, stall=True, crowded=True).expiry is Expiry.ASK  # the next alone
    # ... and the others wait twice as long for it: the core waits for a late rank
    deferred = expire(signs, 0.25, stall=True, crowded=True)
    assert deferred.expiry is Expiry.DEFER and deferred.at == pytest.approx(0.4)
    # No PENDING since that query: every timer goes.
    assert expire(signs, 0.405, stall=True, crowded=True).expiry is Expiry.ASK
    assert expire(signs, 0.41, stall=True, crowded=True).expiry is Expiry.ASK


def test_a_crowded_stall_waits_longer_while_the_core_waits_for_peers() -> None:
    """A rank late by seconds: each query hears a PENDING, and the wait for the next doubles,
    up to one per `silent_query_gap` per segment in flight (64 here: capped by rto_max)."""
    signs = CoreSigns(1)
    asked, now = [], 0.1
    while now < 5.0:
        assert expire(signs, now, stall=True, crowded=True).expiry is Expiry.ASK
        asked.append(round(now, 3))
        signs.heard_at[0] = signs.pending_at[0] = now + 0.001  # ours is in: it waits
        # another segment's timer, meanwhile: it waits for that query's turn to end
        until = signs._stall_until[0]
        assert expire(signs, now + 0.002, stall=True, crowded=True) == Decision(Expiry.DEFER, until)
        now = until
    assert asked[:5] == [0.1, 0.2, 0.4, 0.8, 1.6] and asked[5:] == [2.6, 3.6, 4.6]
    # A result since the last query: the stall moved, and the gap is the RTO again.
    signs.progress_at[0] = 4.7
    assert expire(signs, 5.6, stall=True, crowded=True).expiry is Expiry.ASK
    deferred = expire(signs, 5.65, stall=True, crowded=True)
    assert deferred.expiry is Expiry.DEFER and deferred.at == pytest.approx(5.7)


def test_a_core_waiting_for_peers_is_asked_with_backoff_in_a_clean_round_only() -> None:
    signs = CoreSigns(1)
    signs.heard_at[0] = signs.pending_at[0] = 0.05  # its latest word: it waits for peers
    # A clean round's stall: backed off as for a silent core (8 in flight: up to 0.2)
    assert expire(signs, 0.3, stall=True, last_sent=0.05, timeout=0.1, in_flight=8) == \
        Decision(Expiry.ASK, 0.2, True)
    assert expire(signs, 0.5, stall=True, last_sent=0.3, timeout=0.2, in_flight=8).at == \
        pytest.approx(0.2)
    # A round that repaired a loss: the late rank may be repairing too, asked at the RTO.
    assert expire(signs, 0.3, last_sent=0.05, timeout=0.1, in_flight=8) == \
        Decision(Expiry.ASK, 0.1, False)
    # Its latest word a result (of another segment): ours was lost, asked at the RTO.
    signs.heard_at[0] = 0.06
    assert expire(signs, 0.3, stall=True, last_sent=0.05, timeout=0.1, in_flight=8) == \
        Decision(Expiry.ASK, 0.1, True)
