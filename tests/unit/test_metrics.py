"""The `/metrics` exposition: snapshots built by hand, rendered, parsed back, asserted."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from reduction_appliance.control.metrics import (
    CONTENT_TYPE,
    CORE_COUNTERS,
    CORE_GAUGES,
    LAGGING_SAMPLES,
    SnapshotCollector,
    render,
)
from reduction_appliance.control.snapshot import (
    ApplianceSnapshot,
    CoreSnapshot,
    InterfaceSnapshot,
    JobSnapshot,
)
from reduction_appliance.dataplane.counters import Counter, Counters


def core_counters(**values: int) -> dict[str, int]:
    counters = Counters().snapshot()  # every cell, as the daemon reads them
    counters.update(values)
    return counters


CORE0 = CoreSnapshot(
    index=0,
    pid=4242,
    cpu=1,
    port=4791,
    state="running",
    restarts=0,
    counters=core_counters(
        packets_in=1000,
        bytes_in=8_000_000,
        packets_out=250,
        bytes_out=2_000_000,
        segments_reduced=250,
        bytes_reduced=1_900_000,
        results_resent=3,
        pending_sent=2,
        duplicates=5,
        drop_bad_cookie=7,
        drop_stale=1,
        send_errors=4,
        abort_notices=6,
        slots_in_use=64,
        poll_loops=10_000,
        poll_busy_loops=2_500,
    ),
    busy_fraction=0.25,
)
CORE1 = CoreSnapshot(
    index=1,
    pid=None,
    cpu=None,
    port=4792,
    state="restarting",
    restarts=2,
    counters=core_counters(packets_in=10, drop_malformed=9),
    busy_fraction=0.0,
)
TRAINING = JobSnapshot(
    job_id=7,
    name="resnet",
    state="active",
    world_size=4,
    joined=(0, 1, 2, 3),
    deterministic=True,
    multicast_group="239.1.1.7",
    slots_per_core=32,
    created_s=600.0,
    rounds=42,
    bytes_reduced=1_900_000,
    segments_reduced=250,
    last_activity_s=12.5,
    lagging={3: 12.5},
    contributions_missed={3: 14},
    results_lost={1: 2, 3: 20},
)
WAITING = JobSnapshot(
    job_id=8,
    name="bert",
    state="registered",
    world_size=8,
    joined=(0, 5),
    deterministic=False,
    multicast_group=None,
    slots_per_core=32,
    created_s=3.0,
    rounds=0,
    bytes_reduced=0,
    segments_reduced=0,
    last_activity_s=None,  # no datagram yet
)
SNAPSHOT = ApplianceSnapshot(
    version="0.1.0",
    uptime_s=3600.0,
    config="/etc/reduction/appliance.toml",
    cores=(CORE0, CORE1),
    jobs=(TRAINING, WAITING),
    interfaces=(InterfaceSnapshot(name="eth1", mtu=9000, up=True, multicast_routes=()),),
    fallbacks=("reduce kernels numpy, not torch (ImportError: no torch) (cores 0, 1)",),
    jobs_evicted={"idle": 1, "abandoned": 3},
    jobs_aborted={"operator": 2, "rank": 1},
    late_ranks_refused=4,
)


def samples(snapshot: ApplianceSnapshot = SNAPSHOT) -> list[Sample]:
    text = render(snapshot).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(metric: str, /, **labels: str) -> float:
    """The one sample of `SNAPSHOT` named `metric` whose labels include `labels`."""
    found = [s for s in samples() if s.name == metric and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{metric}{labels}: {found}"
    return found[0].value


def test_appliance_info_and_uptime() -> None:
    assert (
        value("reduction_appliance_info", version="0.1.0", config="/etc/reduction/appliance.toml")
        == 1
    )
    assert value("reduction_appliance_uptime_seconds") == 3600.0
    assert value("reduction_appliance_fallbacks") == 1
    assert value("reduction_appliance_jobs_evicted_total", reason="idle") == 1
    assert value("reduction_appliance_jobs_evicted_total", reason="abandoned") == 3
    assert value("reduction_appliance_jobs_aborted_total", by="operator") == 2
    assert value("reduction_appliance_jobs_aborted_total", by="rank") == 1
    assert value("reduction_appliance_late_ranks_refused_total") == 4


@pytest.mark.parametrize(
    ("name", "core", "expected"),
    [
        ("reduction_core_packets_received_total", "0", 1000),
        ("reduction_core_bytes_received_total", "0", 8_000_000),
        ("reduction_core_packets_sent_total", "0", 250),
        ("reduction_core_bytes_sent_total", "0", 2_000_000),
        ("reduction_core_segments_reduced_total", "0", 250),
        ("reduction_core_bytes_reduced_total", "0", 1_900_000),
        ("reduction_core_results_resent_total", "0", 3),
        ("reduction_core_pending_sent_total", "0", 2),
        ("reduction_core_duplicates_total", "0", 5),
        ("reduction_core_send_errors_total", "0", 4),
        ("reduction_core_abort_notices_sent_total", "0", 6),
        ("reduction_core_poll_loops_total", "0", 10_000),
        ("reduction_core_poll_busy_loops_total", "0", 2_500),
        ("reduction_core_slots_in_use", "0", 64),
        ("reduction_core_poll_busy_ratio", "0", 0.25),
        ("reduction_core_restarts_total", "0", 0),
        ("reduction_core_packets_received_total", "1", 10),
        ("reduction_core_restarts_total", "1", 2),
        ("reduction_core_poll_busy_ratio", "1", 0.0),
    ],
)
def test_core_values(name: str, core: str, expected: float) -> None:
    assert value(name, core=core) == expected


def test_drops_by_reason() -> None:
    assert value("reduction_core_drops_total", core="0", reason="bad_cookie") == 7
    assert value("reduction_core_drops_total", core="0", reason="stale") == 1
    assert value("reduction_core_drops_total", core="1", reason="malformed") == 9
    assert value("reduction_core_drops_total", core="1", reason="bad_cookie") == 0
    reasons = {
        s.labels["reason"]
        for s in samples()
        if s.name == "reduction_core_drops_total" and s.labels["core"] == "0"
    }
    drop_counters = [c.name.lower() for c in Counter if c.name.startswith("DROP_")]
    assert reasons == {name.removeprefix("drop_") for name in drop_counters}


def test_core_info_and_state() -> None:
    assert value("reduction_core_info", core="0", cpu="1", pid="4242", port="4791") == 1
    # Unpinned and not running: empty labels, which Prometheus stores as no label.
    assert value("reduction_core_info", core="1", cpu="", pid="", port="4792") == 1
    assert value("reduction_core_state", core="0", state="running") == 1
    assert value("reduction_core_state", core="1", state="restarting") == 1


def test_every_core_counter_is_exported() -> None:
    for c in Counter:
        key = c.name.lower()
        assert key.startswith("drop_") or key in CORE_COUNTERS or key in CORE_GAUGES, key


def test_job_values() -> None:
    job = {"job_id": "7", "name": "resnet"}
    assert value("reduction_job_rounds_completed_total", **job) == 42
    assert value("reduction_job_bytes_reduced_total", **job) == 1_900_000
    assert value("reduction_job_segments_reduced_total", **job) == 250
    assert value("reduction_job_world_size", **job) == 4
    assert value("reduction_job_joined_ranks", **job) == 4
    assert value("reduction_job_age_seconds", **job) == 600.0
    assert value("reduction_job_last_activity_age_seconds", **job) == 12.5
    assert value("reduction_job_state", state="active", **job) == 1
    assert (
        value("reduction_job_info", multicast_group="239.1.1.7", deterministic="true", **job) == 1
    )


def test_lagging_ranks() -> None:
    assert value("reduction_job_lagging_rank_seconds", job_id="7", name="resnet", rank="3") == 12.5
    assert value("reduction_job_lagging_ranks", job_id="7", name="resnet") == 1
    assert value("reduction_job_lagging_ranks", job_id="8", name="bert") == 0
    lagging = [s for s in samples() if s.name == "reduction_job_lagging_rank_seconds"]
    assert [s.labels["rank"] for s in lagging] == ["3"]


def test_loss_by_rank() -> None:
    job = {"job_id": "7", "name": "resnet"}
    assert value("reduction_job_rank_contributions_missed_total", rank="3", **job) == 14
    assert value("reduction_job_rank_results_lost_total", rank="3", **job) == 20
    assert value("reduction_job_rank_results_lost_total", rank="1", **job) == 2
    missed = [s for s in samples() if s.name == "reduction_job_rank_contributions_missed_total"]
    assert [s.labels["rank"] for s in missed] == ["3"]  # ranks without loss have no sample


def test_job_without_activity_renders() -> None:
    job = {"job_id": "8", "name": "bert"}
    assert value("reduction_job_joined_ranks", **job) == 2
    assert value("reduction_job_world_size", **job) == 8
    assert value("reduction_job_rounds_completed_total", **job) == 0
    assert value("reduction_job_state", state="registered", **job) == 1
    assert not [
        s
        for s in samples()
        if s.name == "reduction_job_last_activity_age_seconds" and s.labels["job_id"] == "8"
    ]
    assert all(not math.isnan(s.value) for s in samples())


def test_interfaces() -> None:
    assert value("reduction_interface_up", interface="eth1") == 1
    assert value("reduction_interface_mtu_bytes", interface="eth1") == 9000


def test_empty_appliance_renders() -> None:
    empty = ApplianceSnapshot(version="0.1.0", uptime_s=0.0, config="", cores=(), jobs=())
    names = {s.name for s in samples(empty)}
    assert names == {"reduction_appliance_info", "reduction_appliance_uptime_seconds",
                     "reduction_appliance_segment_bytes",
                     "reduction_appliance_janitor_errors_total", "reduction_appliance_fallbacks",
                     "reduction_api_requests_abandoned_total",
                     "reduction_appliance_late_ranks_refused_total"}


def test_names_follow_conventions() -> None:
    text = render(SNAPSHOT).decode()
    families = list(text_string_to_metric_families(text))
    assert families
    for family in families:
        assert family.name.startswith("reduction_"), family.name
        assert family.documentation, family.name
        for s in family.samples:
            if family.type == "counter":
                assert s.name.endswith("_total"), s.name
            else:
                assert not s.name.endswith("_total"), s.name


def test_collector_takes_one_snapshot_per_scrape() -> None:
    calls: list[int] = []

    def snapshot() -> ApplianceSnapshot:
        calls.append(1)
        return SNAPSHOT

    collector = SnapshotCollector(snapshot)
    assert list(collector.describe()) == []  # registering takes no snapshot
    assert not calls
    families = list(collector.collect())
    assert len(calls) == 1 and families


def test_content_type() -> None:
    assert CONTENT_TYPE.startswith("text/plain")


def test_a_big_job_gives_samples_to_its_sixteen_longest_lagging_ranks() -> None:
    """A job of thousands of ranks waits for hundreds at any moment of a round: a series per
    rank would churn the server's index. The longest waited for keep theirs (the alert's
    `max` is theirs), the count covers them all."""
    big = replace(TRAINING, lagging={r: 0.001 * r for r in range(3000)})
    got = samples(replace(SNAPSHOT, jobs=(big,)))
    ranks = [s.labels["rank"] for s in got if s.name == "reduction_job_lagging_rank_seconds"]
    assert ranks == [str(r) for r in range(3000 - LAGGING_SAMPLES, 3000)]
    assert [s.value for s in got if s.name == "reduction_job_lagging_ranks"] == [3000]
