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
    deferred = expire(signs, 0.25, stall=True, crowded=True)
    assert deferred.expiry is Expiry.DEFER and deferred.at == pytest.approx(0.3)
    # No PENDING since that query: every timer goes.
    assert expire(signs, 0.305, stall=True, crowded=True).expiry is Expiry.ASK
    assert expire(signs, 0.31, stall=True, crowded=True).expiry is Expiry.ASK
