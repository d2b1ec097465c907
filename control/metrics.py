"""Prometheus exposition of an `ApplianceSnapshot`: what `/metrics` serves.

The data plane's counters flow one way (design §1): each core writes its own counters in shared
memory, the daemon reads them into a plain-values `ApplianceSnapshot`, and this module renders
that snapshot. It never reaches into the data plane and keeps no state between scrapes: every
scrape asks for a fresh snapshot, so counters reset only when a core or a job does.

Families (all prefixed `reduction_`):

- `appliance_info{version, config}`, `appliance_uptime_seconds`, `appliance_segment_bytes`;
- per core, labelled `core`: `core_info{cpu, pid, port}`, `core_state{state}`, the traffic
  counters of `CORE_COUNTERS`, `core_drops_total{reason}` (one sample per `drop_*` counter:
  reason is the counter name without `drop_`), `core_slots_in_use`, `core_poll_busy_ratio`,
  `core_restarts_total`;
- per job, labelled `job_id, name`: `job_info{multicast_group, deterministic, transport}`,
  `job_state{state}`, rounds/bytes/segments counters, world size, joined ranks, age, seconds since
  the last accepted contribution (absent until the first one), and the lagging ranks:
  `job_lagging_rank_seconds{rank}` (one sample per rank a started segment still waits for, the
  `LAGGING_SAMPLES` waited for longest: a job of thousands of ranks waits for hundreds at any
  moment of a round, and a series each would churn the server's index) and
  `job_lagging_ranks` (how many), so a stuck job is diagnosable at a glance;
  `job_rank_contributions_missed{rank}` and `job_rank_results_lost{rank}` (where its datagrams
  are lost: one rank far above the others is its cable, its port or its host);
- per interface, labelled `interface`: `interface_up`, `interface_mtu_bytes`.

Enumerated states are one gauge sample of value 1 whose `state` label names the current state
(alert with e.g. `reduction_core_state{state!="running"}`). A label for a value that is absent
(an unpinned core's `cpu`, a stopped core's `pid`) is the empty string, which Prometheus treats
as no label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from reduction_appliance.control.counter_metrics import CORE_COUNTERS, CORE_GAUGES
from reduction_appliance.control.snapshot import ApplianceSnapshot, CoreSnapshot, JobSnapshot
from reduction_appliance.dataplane.counters import Counter

__all__ = ["CONTENT_TYPE", "CORE_COUNTERS", "CORE_GAUGES", "LAGGING_SAMPLES", "SnapshotCollector",
           "render"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The `Content-Type` to serve `render()`'s bytes with."""

PREFIX = "reduction_"
DROP_PREFIX = "drop_"
LAGGING_SAMPLES = 16  # lagging ranks with a sample of their own per job, the longest waited
"""Every core counter named `drop_<reason>` becomes a sample of `reduction_core_drops_total`."""
DROP_REASONS = tuple(c.name.lower().removeprefix(DROP_PREFIX) for c in Counter
                     if c.name.lower().startswith(DROP_PREFIX))

CORE_LABELS = ["core"]
JOB_LABELS = ["job_id", "name"]


class SnapshotCollector(Collector):
    """Collects the metric families of one fresh `ApplianceSnapshot` per scrape.

    `snapshot` is called once per `collect()`; an exception it raises propagates, so the scrape
    fails visibly rather than serving stale or partial numbers.
    """

    def __init__(self, snapshot: Callable[[], ApplianceSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        # Declared empty so registering does not take a snapshot (the registry would otherwise
        # call collect() to learn the names).
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from _appliance_families(snap)
        yield from _core_families(snap.cores)
        yield from _job_families(snap.jobs)
        yield from _interface_families(snap)


def render(snapshot: ApplianceSnapshot) -> bytes:
    """The text exposition of `snapshot`, to serve with `CONTENT_TYPE`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry)


def _counter(name: str, documentation: str, values: dict[tuple[str, ...], int],
             labels: list[str] | None = None) -> CounterMetricFamily:
    """A counter family of `values` by their label values (`()` where it has no labels)."""
    family = CounterMetricFamily(PREFIX + name, documentation, labels=labels or [])
    for label_values, value in values.items():
        family.add_metric(list(label_values), value)
    return family


def _appliance_families(snap: ApplianceSnapshot) -> Iterator[Metric]:
    info = InfoMetricFamily(
        PREFIX + "appliance",
        "The running appliance: software version and the configuration file it loaded.",
    )
    info.add_metric([], {"version": snap.version, "config": snap.config})
    yield info
    yield _counter(
        "appliance_janitor_errors",
        "Periodic chores of the daemon (rates, idle eviction) and core-monitor passes that "
        "failed and were survived; each is one log line.", {(): snap.janitor_errors})
    yield _counter(
        "api_requests_abandoned",
        "API requests whose client closed its connection before a handler took them, so not "
        "served: callers whose attempts time out before the API answers (a job of thousands "
        "of ranks joining at once on a slow appliance), and that ask again.",
        {(): snap.api_requests_abandoned})
    yield _counter(
        "appliance_jobs_evicted",
        "Jobs the appliance removed itself since it started: idle (nothing heard from any rank "
        "for jobs.idle_timeout_s) or abandoned (every joined rank silent for twice the "
        "liveness timeout: workers gone without leaving).",
        {(cause,): n for cause, n in sorted(snap.jobs_evicted.items())}, ["reason"])
    yield _counter(
        "appliance_jobs_aborted",
        "Jobs aborted since the appliance started: by an operator (reductionctl abort), or by "
        "one of their ranks that found the job cannot go on (a path too narrow).",
        {(by,): n for by, n in sorted(snap.jobs_aborted.items())}, ["by"])
    yield _counter(
        "appliance_late_ranks_refused",
        "Joins refused because their job had been aborted before the rank came (a worker "
        "that started late): it is told why, and a job it registered after the abort goes.",
        {(): snap.late_ranks_refused})
    yield GaugeMetricFamily(
        PREFIX + "appliance_fallbacks",
        "Things the appliance gave up on this host (slower kernels, unicast instead of "
        "multicast, no GSO); `reductionctl status` and the log say which and why.",
        value=len(snap.fallbacks),
    )
    yield GaugeMetricFamily(
        PREFIX + "appliance_segment_bytes",
        "Payload bytes of one UDP segment: the largest datagram the data path's MTU carries "
        "without fragmenting, less the headers (status says where the MTU came from).",
        value=snap.segment_bytes,
    )
    yield GaugeMetricFamily(
        PREFIX + "appliance_uptime_seconds",
        "Seconds since the appliance daemon started.",
        value=snap.uptime_s,
    )


def _optional(value: int | None) -> str:
    return "" if value is None else str(value)


def _core_families(cores: tuple[CoreSnapshot, ...]) -> Iterator[Metric]:
    info = InfoMetricFamily(
        PREFIX + "core",
        "A data-plane core: the CPU it is pinned to (empty: unpinned), its process id (empty: "
        "not running) and its UDP port.",
        labels=CORE_LABELS,
    )
    state = GaugeMetricFamily(
        PREFIX + "core_state",
        "1 for the core's current state (running, restarting, stopped), named by the state label.",
        labels=[*CORE_LABELS, "state"],
    )
    restarts = CounterMetricFamily(
        PREFIX + "core_restarts",
        "Times the supervisor restarted the core's process; moves on each restart.",
        labels=CORE_LABELS,
    )
    busy = GaugeMetricFamily(
        PREFIX + "core_poll_busy_ratio",
        "Fraction of poll-loop iterations that found work, since the core's process started "
        "(0: idle, 1: saturated).",
        labels=CORE_LABELS,
    )
    counters = {
        key: CounterMetricFamily(PREFIX + name, text, labels=CORE_LABELS)
        for key, (name, text) in CORE_COUNTERS.items()
    }
    gauges = {
        key: GaugeMetricFamily(PREFIX + name, text, labels=CORE_LABELS)
        for key, (name, text) in CORE_GAUGES.items()
    }
    drops = CounterMetricFamily(
        PREFIX + "core_drops",
        "Datagrams dropped and counted instead of processed, by reason "
        f"({', '.join(DROP_REASONS)}); moves each time the core discards a datagram.",
        labels=[*CORE_LABELS, "reason"],
    )
    for core in cores:
        labels = [str(core.index)]
        info.add_metric(
            labels, {"cpu": _optional(core.cpu), "pid": _optional(core.pid), "port": str(core.port)}
        )
        state.add_metric([*labels, core.state], 1.0)
        restarts.add_metric(labels, core.restarts)
        busy.add_metric(labels, core.busy_fraction)
        _add_core_counters(core.counters, labels, counters, gauges, drops)
    yield info
    yield state
    yield restarts
    yield busy
    yield from counters.values()
    yield from gauges.values()
    yield drops


def _add_core_counters(
    values: Mapping[str, int],
    labels: list[str],
    counters: Mapping[str, CounterMetricFamily],
    gauges: Mapping[str, GaugeMetricFamily],
    drops: CounterMetricFamily,
) -> None:
    # Only cells present in the snapshot are exported: a core whose counters could not be read
    # shows no samples rather than false zeros.
    for key, value in sorted(values.items()):
        if key.startswith(DROP_PREFIX):
            drops.add_metric([*labels, key.removeprefix(DROP_PREFIX)], value)
        elif key in counters:
            counters[key].add_metric(labels, value)
        elif key in gauges:
            gauges[key].add_metric(labels, value)


def _job_families(jobs: tuple[JobSnapshot, ...]) -> Iterator[Metric]:
    info = InfoMetricFamily(
        PREFIX + "job",
        "A registered job: its multicast group (empty: unicast results), whether it reduces "
        "in fixed rank order (bitwise-reproducible results), and its transport (udp, roce).",
        labels=JOB_LABELS,
    )
    state = GaugeMetricFamily(
        PREFIX + "job_state",
        "1 for the job's current registry state, named by the state label.",
        labels=[*JOB_LABELS, "state"],
    )
    rounds = CounterMetricFamily(
        PREFIX + "job_rounds_completed",
        "Allreduce rounds the job completed (the highest complete round seen on any core); "
        "moves when a round's last segment completes. Resets (as a counter restarting) when a "
        "rank joins the job again and when round numbers wrap after 4294967295.",
        labels=JOB_LABELS,
    )
    nbytes = CounterMetricFamily(
        PREFIX + "job_bytes_reduced",
        "Payload bytes of the job's completed segments, summed over cores; moves when a segment "
        "completes.",
        labels=JOB_LABELS,
    )
    segments = CounterMetricFamily(
        PREFIX + "job_segments_reduced",
        "The job's segments completed on all cores; moves when a segment completes.",
        labels=JOB_LABELS,
    )
    world = GaugeMetricFamily(
        PREFIX + "job_world_size",
        "Ranks the job was registered with.",
        labels=JOB_LABELS,
    )
    joined = GaugeMetricFamily(
        PREFIX + "job_joined_ranks",
        "Ranks that have joined the job so far (equals world_size once everyone is in).",
        labels=JOB_LABELS,
    )
    age = GaugeMetricFamily(
        PREFIX + "job_age_seconds",
        "Seconds since the job was registered.",
        labels=JOB_LABELS,
    )
    idle = GaugeMetricFamily(
        PREFIX + "job_last_activity_age_seconds",
        "Seconds since the appliance last accepted a contribution of the job; absent until the "
        "first.",
        labels=JOB_LABELS,
    )
    lagging = GaugeMetricFamily(
        PREFIX + "job_lagging_rank_seconds",
        "Seconds the appliance has waited for this rank: the age of the oldest segment other "
        "ranks have started that still misses its contribution; one sample per lagging rank, "
        f"for the {LAGGING_SAMPLES} waited for longest (job_lagging_ranks counts them all).",
        labels=[*JOB_LABELS, "rank"],
    )
    n_lagging = GaugeMetricFamily(
        PREFIX + "job_lagging_ranks",
        "Ranks the appliance is currently waiting for (0: none; see job_lagging_rank_seconds).",
        labels=JOB_LABELS,
    )
    missed = CounterMetricFamily(
        PREFIX + "job_rank_contributions_missed",
        "Contributions of this rank that never reached a core (numbers its later ones skipped), "
        "summed over cores; one sample per rank with any. Its uplink's loss.",
        labels=[*JOB_LABELS, "rank"],
    )
    lost = CounterMetricFamily(
        PREFIX + "job_rank_results_lost",
        "Results this rank lost on their way (it heard a later one of the core first, then "
        "asked for this one), summed over cores; one sample per rank with any. Its downlink's "
        "loss, or its host's socket's.",
        labels=[*JOB_LABELS, "rank"],
    )
    for job in jobs:
        labels = [str(job.job_id), job.name]
        for rank, n in job.contributions_missed.items():
            missed.add_metric([*labels, str(rank)], n)
        for rank, n in job.results_lost.items():
            lost.add_metric([*labels, str(rank)], n)
        info.add_metric(
            labels,
            {
                "multicast_group": job.multicast_group or "",
                "deterministic": str(job.deterministic).lower(),
                "transport": job.transport,
            },
        )
        state.add_metric([*labels, job.state], 1.0)
        rounds.add_metric(labels, job.rounds)
        nbytes.add_metric(labels, job.bytes_reduced)
        segments.add_metric(labels, job.segments_reduced)
        world.add_metric(labels, job.world_size)
        joined.add_metric(labels, len(job.joined))
        age.add_metric(labels, job.created_s)
        if job.last_activity_s is not None:
            idle.add_metric(labels, job.last_activity_s)
        longest = sorted(job.lagging.items(), key=lambda rw: (-rw[1], rw[0]))[:LAGGING_SAMPLES]
        for rank, waited in sorted(longest):
            lagging.add_metric([*labels, str(rank)], waited)
        n_lagging.add_metric(labels, len(job.lagging))
    yield from (info, state, rounds, nbytes, segments, world, joined, age, idle)
    yield from (lagging, n_lagging, missed, lost)


def _interface_families(snap: ApplianceSnapshot) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        PREFIX + "interface_up",
        "1 if the data-plane network interface is up, else 0.",
        labels=["interface"],
    )
    mtu = GaugeMetricFamily(
        PREFIX + "interface_mtu_bytes",
        "MTU of the data-plane network interface.",
        labels=["interface"],
    )
    for iface in snap.interfaces:
        up.add_metric([iface.name], 1.0 if iface.up else 0.0)
        mtu.add_metric([iface.name], iface.mtu)
    yield up
    yield mtu
