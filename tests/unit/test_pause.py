"""A worker's own pause is not its appliance's silence (plugin/pipeline.py, simulated time).

A rank's process paused (SIGSTOP, a debugger, a VM migrated, a swap storm) longer than the
liveness timeout once failed its round at once on waking with `ApplianceSilent` and a diagnosis
blaming a firewall: its clock had moved on while nothing could be heard, and its lease thread
had sent no heartbeat for the appliance to answer. An appliance is silent only while this
rank's heartbeats went out."""

from __future__ import annotations

from reduction_appliance.dataplane.errors import ApplianceSilent
from reduction_appliance.dataplane.wire import DType, Op
from reduction_appliance.plugin.pipeline import RoundPipeline
from reduction_appliance.plugin.rtt import RttEstimator, Timing
from reduction_appliance.plugin.session import Endpoint

LIVENESS_S = 5.0


def pipeline() -> RoundPipeline:
    endpoints = (Endpoint(("198.18.0.1", 7000), 1, 99, 4, "appliance 198.18.0.1:7070 core 0"),)
    p = RoundPipeline(endpoints, 0, 2, 64, RttEstimator(Timing(deadline=60.0)),
                      liveness_timeout=LIVENESS_S)
    p.submit(DType.FLOAT32, Op.SUM, 64)
    p.due(0.0)
    p.heard(0, 0.1)
    return p


def silent_by(p: RoundPipeline, now: float) -> str | None:
    p.due(now)
    failed = [o.error for o in p.finished() if type(o.error) is ApplianceSilent]
    return str(failed[0]) if failed else None


def beating(p: RoundPipeline, start: float, end: float) -> None:
    """The lease thread's heartbeats, ten per liveness timeout, none of them answered."""
    for k in range(round((end - start) / 0.5) + 1):
        p.beat(start + k * 0.5)


def test_an_appliance_unheard_while_the_heartbeats_go_out_is_silent() -> None:
    p = pipeline()
    beating(p, 0.0, 5.0)
    assert silent_by(p, 5.0) is None
    said = silent_by(p, 5.2)
    assert said is not None and said.startswith(
        "appliance 198.18.0.1:7070 has sent nothing for 5.1 s (liveness timeout 5 s)")


def test_a_pipeline_without_a_lease_judges_by_what_it_heard_alone() -> None:
    p = pipeline()  # (a caller with no lease thread: beat() is never called)
    assert silent_by(p, 5.0) is None
    assert silent_by(p, 5.2) is not None


def test_a_rank_back_from_a_pause_counts_the_silence_from_its_return() -> None:
    """Paused from 3.0 s to 9.0 s. Waking, the driving thread turns before the lease thread
    beats: no verdict. The silence counts from the first heartbeat after the pause (9.5 s):
    only then could the appliance answer."""
    p = pipeline()
    beating(p, 0.0, 3.0)
    assert silent_by(p, 9.0) is None  # back: the lease thread has not beaten yet
    beating(p, 9.5, 14.0)
    assert silent_by(p, 14.0) is None
    beating(p, 14.5, 14.5)
    assert silent_by(p, 14.5) is None
    said = silent_by(p, 14.6)
    assert said is not None and "has sent nothing for 5.1 s" in said


def test_the_lease_beating_first_after_a_pause_counts_from_its_beat() -> None:
    p = pipeline()
    beating(p, 0.0, 3.0)
    beating(p, 9.0, 14.0)  # the lease thread woke first
    assert silent_by(p, 13.9) is None
    assert silent_by(p, 14.1) is not None
