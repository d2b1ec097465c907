"""What the appliance looks like at one instant: plain values for status, metrics and the CLI.

The daemon assembles a snapshot from the data plane's shared-memory counters (per core) and the
cores' per-job statistics (asked through their mailboxes); `metrics.py` renders it for
Prometheus and `reductionctl status` prints it. Neither reaches into the data plane itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .activity import Activity
from .jobplan import JobPlan

__all__ = ["ApplianceSnapshot", "CoreSnapshot", "InterfaceSnapshot", "JobSnapshot",
           "job_snapshot"]


@dataclass(frozen=True)
class CoreSnapshot:
    index: int
    pid: int | None
    cpu: int | None  # pinned CPU, None when unpinned
    port: int
    state: str  # dataplane.spec.CoreState value: starting, running, restarting, stopped
    restarts: int
    counters: dict[str, int]  # dataplane.counters.Counter names, lower case
    busy_fraction: float  # poll loops that found work / all poll loops, since start
    packets_per_s: float = 0.0  # received, over the last sampling second
    bytes_per_s: float = 0.0  # received, over the last sampling second
    kernels: str = ""  # the reduce-kernel backend the core chose
    last_exit: str = ""  # why it last died or was killed (stalled), when it ever did
    # RDMA connections (config [roce]): address, local and remote ends, state, sends in flight
    queue_pairs: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class JobSnapshot:
    job_id: int
    name: str
    state: str  # registry state name, lower case
    world_size: int
    joined: tuple[int, ...]  # ranks that joined
    deterministic: bool
    multicast_group: str | None
    slots_per_core: int
    created_s: float  # seconds since the job was created
    rounds: int  # allreduce rounds completed (the highest complete round seen on any core)
    bytes_reduced: int  # summed over cores
    segments_reduced: int
    last_activity_s: float | None  # seconds since its last datagram; None: none yet
    lagging: dict[int, float] = field(default_factory=dict)  # rank -> seconds waited for it
    disruptions: tuple[str, ...] = ()  # data-plane restarts while the job was registered
    epoch: int = 1  # resynchronisations: a rank re-joined, or the ranks resynced
    endpoints: dict[int, str] = field(default_factory=dict)  # rank -> "host:port" it joined from
    diverged: str | None = None  # why the ranks disagree (a core said so), until a new epoch
    silent: dict[int, float] = field(default_factory=dict)  # rank -> seconds without a word
    # ranks whose host said nothing listens at their endpoint any more, not heard since: their
    # process ended without leaving (killed, crashed, exited: dataplane.reach)
    ended: tuple[int, ...] = ()
    # joined rank -> seconds since a core last heard it (a datagram from where it joined)
    heard_s: dict[int, float] = field(default_factory=dict)
    # rank -> "host:port" its datagrams came from instead of where it joined (a NAT between)
    seen_elsewhere: dict[int, str] = field(default_factory=dict)
    # Where its datagrams are lost, by rank (ranks with none left out), summed over cores:
    # the rank's contributions that never came (its uplink), results it is known to have lost
    # (it heard a later one first: its downlink, or its host's socket)
    contributions_missed: dict[int, int] = field(default_factory=dict)
    results_lost: dict[int, int] = field(default_factory=dict)
    # rank -> the window per core its host's receive buffer holds, where fewer than the slots
    windows_held: dict[int, int] = field(default_factory=dict)
    transport: str = "udp"  # or "roce": its ranks' queue pairs are in the cores' queue_pairs


@dataclass(frozen=True)
class InterfaceSnapshot:
    name: str
    mtu: int
    up: bool
    multicast_routes: tuple[str, ...]


@dataclass(frozen=True)
class ApplianceSnapshot:
    version: str
    uptime_s: float
    config: str
    cores: tuple[CoreSnapshot, ...]
    jobs: tuple[JobSnapshot, ...]
    interfaces: tuple[InterfaceSnapshot, ...] = ()
    steering: tuple[str, ...] = ()  # human descriptions of the installed rules
    steering_notes: tuple[str, ...] = ()  # what could not be steered here, and why
    rdma_devices: tuple[str, ...] = ()
    janitor_errors: int = 0  # the daemon's periodic chores that failed (each logged once)
    # API requests whose client closed its end before a handler took them (not served)
    api_requests_abandoned: int = 0
    jobs_evicted: dict[str, int] = field(default_factory=dict)  # since start, by cause
    jobs_aborted: dict[str, int] = field(default_factory=dict)  # since start: operator, rank
    late_ranks_refused: int = 0  # joins that came after their job's abort (control/aborts.py)
    fallbacks: tuple[str, ...] = ()  # what the appliance gave up on this host, and why
    segment_bytes: int = 0  # a UDP job's segment: the largest payload the path carries
    segment_origin: str = ""  # how that was chosen ("MTU 9000 of interface eth1, ...")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def job_snapshot(plan: JobPlan, act: Activity, now: float,
                 disruptions: tuple[str, ...]) -> JobSnapshot:
    """One job as the registry has it (`plan`) and its cores saw it (`act`), ages at `now`."""
    mc = plan.spec.multicast
    return JobSnapshot(
        job_id=act.job_id, name=plan.name, state=plan.state.value,
        world_size=plan.spec.world_size, joined=tuple(sorted(plan.joined)),
        deterministic=plan.spec.deterministic, transport=plan.request.transport,
        multicast_group=mc[0] if mc else None, slots_per_core=plan.spec.slots,
        created_s=now - plan.created, rounds=act.rounds,
        bytes_reduced=act.bytes_reduced, segments_reduced=act.segments_reduced,
        last_activity_s=None if act.last_activity is None else now - act.last_activity,
        lagging={r: round(w, 3) for r, w in sorted(act.lagging.items())},
        epoch=plan.spec.epoch, diverged=act.diverged,
        silent={r: round(s, 1) for r, s in sorted(act.silent.items())},
        ended=tuple(sorted(act.ended)),
        heard_s={r: round(s, 3) for r, s in sorted(act.heard.items())},
        seen_elsewhere={r: f"{a[0]}:{a[1]}" for r, a in sorted(act.elsewhere.items())},
        contributions_missed=dict(sorted(act.missed.items())),
        results_lost=dict(sorted(act.lost.items())),
        windows_held=dict(sorted(plan.windows_held.items())),
        endpoints={r: f"{a[0]}:{a[1]}" for r, a in enumerate(plan.spec.endpoints)
                   if a is not None},
        disruptions=disruptions,
    )
