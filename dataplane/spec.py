"""The contract between the control plane and a data-plane core: the only data-plane types the
control plane builds or reads (with the counters, the errors and the wire format).

A core is a separate process; the control plane talks to it through a pipe (its mailbox):

    control -> core   Request(id, command)      one of the `Command` classes below
    core -> control   Ready(core)               once, when the core serves
    core -> control   Reply(id, value, error)   one per request, in order, same id

Every command declares the type of its reply value (`reply_type`), so the supervisor hands its
callers typed values, and a refusal travels as an `ErrorReport` naming the exception's class,
which the supervisor raises again as that class (an `AdmissionError` stays one; an unexpected
exception inside a core becomes a `CoreFailure`, our bug, never a caller's 4xx). A command the
core does not know is answered with an error too; the core goes on serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Generic, Literal, TypeVar

from .errors import CoreFailure, ReductionError, by_name

__all__ = [
    "KERNEL_BACKENDS",
    "AbortJob",
    "AcceptQueuePair",
    "AddJob",
    "Address",
    "Command",
    "CoreConfig",
    "CoreState",
    "CoreStats",
    "ErrorReport",
    "FenceJobs",
    "Fenced",
    "Fences",
    "JobSpec",
    "JobStats",
    "PollMode",
    "QueryStats",
    "QueuePairs",
    "Ready",
    "ReleaseQueuePairs",
    "RemoveJob",
    "Reply",
    "Request",
    "RoceSettings",
    "Stop",
    "UpdateJob",
]

Address = tuple[str, int]
PollMode = Literal["busy", "adaptive"]
#: The reduce-kernel backends a core can be told to use (dataplane.reduce), best first.
KERNEL_BACKENDS = ("torch", "numpy+ml_dtypes", "numpy")
R = TypeVar("R")


# ---- what a core is told --------------------------------------------------------------------

@dataclass(frozen=True)
class RoceSettings:
    """A core's RDMA device (config [roce]): RC queue pairs beside its UDP socket."""

    device: str
    port: int = 1
    gid_index: int = 1
    send_depth: int = 64  # send work requests in flight per queue pair
    queue_pairs: int = 64  # connections one core serves


@dataclass(frozen=True)
class CoreConfig:
    """One data-plane core's start-up configuration (from the appliance config)."""

    index: int
    cpu: int | None  # pinned CPU; None = unpinned
    bind: Address  # UDP address the core receives on
    max_payload: int  # largest segment in bytes
    slot_capacity: int  # slot pairs in the arena
    rx_buffers: int  # receive buffers in the arena
    poll: PollMode = "adaptive"
    spin_us: int = 200
    burst: int = 64  # datagrams per receive burst
    multicast_interface: str | None = None  # local IPv4 address results are multicast from
    multicast_ttl: int = 1
    multicast_loop: bool = True  # deliver results to workers on this host too
    tos: int = 0  # IP TOS byte (DSCP << 2) marked on every datagram the core sends
    kernels: str | None = None  # reduce-kernel backend; None = the best available
    roce: RoceSettings | None = None  # RoCE beside UDP; None = UDP only


@dataclass(frozen=True)
class JobSpec:
    """What one core needs to know about a job. `multicast` None means unicast fan-out.

    `endpoints[rank]` is the address rank joined from (None until it joins): the only source
    its contributions are accepted from and where its results and notices go. `epoch` counts
    the job's resynchronisations: a change resets every slot. `hold_buffers` is the job's quota
    of receive buffers for out-of-turn contributions (deterministic mode), reserved at
    admission. `departed`: ranks that left the job and have not joined again (their peers,
    told they are silent, are told they left)."""

    job_id: int
    cookie: int
    world_size: int
    slots: int
    deterministic: bool = False
    multicast: Address | None = None
    epoch: int = 1
    endpoints: tuple[Address | None, ...] = ()
    hold_buffers: int = 0
    liveness_timeout: float = 5.0  # a rank silent this long is reported to the others
    departed: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if len(self.endpoints) < self.world_size:  # not joined yet: no endpoints
            pad = (None,) * (self.world_size - len(self.endpoints))
            object.__setattr__(self, "endpoints", (*self.endpoints, *pad))


@dataclass(frozen=True)
class JobStats:
    """One core's view of one job, for status and metrics."""

    rounds: int
    bytes_reduced: int
    segments_reduced: int
    last_activity: float | None  # the core's monotonic time of its last accepted contribution
    waiting: dict[int, float]  # rank -> since when (core time) some filling segment waits for it
    diverged: str | None = None  # why the ranks disagree (until the next epoch)
    # rank -> seconds silent: past the timeout, or gone (left) while a use here waits for it
    silent: dict[int, float] = field(default_factory=dict)
    # seconds since the core last heard any rank of the job (a heartbeat counts), or since it
    # got the job: live workers heartbeat, so only a job whose workers are gone grows quiet
    quiet_s: float | None = None
    # joined rank -> seconds since the core last heard it (or got the job): a worker that
    # hears nothing from the appliance asks whether its own datagrams arrive
    heard: dict[int, float] = field(default_factory=dict)
    # rank -> another endpoint its datagrams (its cookie and all) came from: dropped, counted
    # as DROP_BAD_SOURCE; a NAT between it and the appliance, or a restarted worker not yet
    # re-joined
    elsewhere: dict[int, Address] = field(default_factory=dict)
    # rank -> its contributions found never to have come / results it is known to have lost
    # (ranks with none left out): where the job's datagrams are lost
    missed_from: dict[int, int] = field(default_factory=dict)
    lost_to: dict[int, int] = field(default_factory=dict)
    # ranks whose host said nothing listens at their endpoint, overdue here and not heard
    # since: their process ended without leaving (dataplane.reach)
    ended: tuple[int, ...] = ()


@dataclass(frozen=True)
class CoreStats:
    """The reply to `QueryStats`: the core's clock (to turn its times into ages) and per job
    its stats, None for a job the core does not have; and what it has fallen back from so
    far (a transport can give up GSO at its first send, long after Ready)."""

    now: float
    jobs: dict[int, JobStats | None]
    fallbacks: tuple[str, ...] = ()


class Command(Generic[R]):
    """A mailbox command whose reply value has type R (checked when the reply arrives)."""

    reply_type: ClassVar[type] = type(None)


@dataclass(frozen=True)
class AddJob(Command[None]):
    spec: JobSpec


@dataclass(frozen=True)
class UpdateJob(Command[None]):
    """The job's endpoints, departed ranks or epoch changed (a rank joined, re-joined or left,
    or the ranks resynced).
    A new epoch empties every slot and tells every bound worker (RESYNC)."""

    spec: JobSpec


@dataclass(frozen=True)
class RemoveJob(Command[None]):
    """Forget the job; its workers' later datagrams are dropped as of an unknown job."""

    job_id: int


@dataclass(frozen=True)
class AbortJob(Command[None]):
    """Forget the job and tell its workers (ABORTED, with `reason`), now and whenever they
    send again."""

    job_id: int
    reason: str = ""  # what the workers' error says: who aborted the job and why


@dataclass(frozen=True)
class Fenced:
    """One core's view of a draining job (`FenceJobs`, dataplane.fence)."""

    fence: int  # the newest round that may still start here (0: none may)
    unfinished: int  # segments of rounds up to it still waiting for contributions here
    quiet_s: float  # since a contribution or query of those rounds last came (inf: never)
    # where every one of those segments waits for a rank that cannot come (not joined, left,
    # or ended: `FenceJobs.ended`, or found here): those ranks; else empty
    stuck_on: tuple[int, ...] = ()
    ended: tuple[int, ...] = ()  # the ranks this core found ended (dataplane.reach)


@dataclass(frozen=True)
class Fences:
    """The reply to `FenceJobs`: per job its `Fenced`, None where the core lacks the job."""

    jobs: dict[int, Fenced | None]


@dataclass(frozen=True)
class FenceJobs(Command[Fences]):
    """Drain these jobs (the appliance is stopping): no round after a job's fence may start
    on this core. `floors`: (job, round) pairs, the fence each job must at least have (the
    newest round any core has begun; 0: none), so every core lets the same rounds finish.
    `ended`: (job, ranks) pairs, the ranks some core found ended (`Fenced.ended`): they cannot
    come on any core."""

    floors: tuple[tuple[int, int], ...]
    ended: tuple[tuple[int, tuple[int, ...]], ...] = ()
    reply_type: ClassVar[type] = Fences


@dataclass(frozen=True)
class QueryStats(Command[CoreStats]):
    job_ids: tuple[int, ...]
    reply_type: ClassVar[type] = CoreStats


@dataclass(frozen=True)
class AcceptQueuePair(Command[dict]):  # type: ignore[type-arg]
    """Connect an RC queue pair to a worker's end (`dataplane.verbs.QpEndpoint.as_json`); the
    worker's messages arrive from `address`. The reply is the core's end, as JSON."""

    remote: dict[str, Any]
    address: Address
    reply_type: ClassVar[type] = dict


@dataclass(frozen=True)
class ReleaseQueuePairs(Command[None]):
    """Destroy the queue pairs of these worker addresses (their job has gone)."""

    addresses: tuple[Address, ...]


@dataclass(frozen=True)
class QueuePairs(Command[list]):  # type: ignore[type-arg]
    """The core's RDMA connections, for status (empty without RoCE)."""

    reply_type: ClassVar[type] = list


@dataclass(frozen=True)
class Stop(Command[None]):
    """Reply, then leave the poll loop and release everything."""


# ---- the envelope ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    id: int
    command: Command[Any]


@dataclass(frozen=True)
class ErrorReport:
    """An exception raised inside a core, by class name (see `errors.by_name`)."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> ErrorReport:
        return cls(type(exc).__name__, str(exc))

    def exception(self, core: int) -> ReductionError:
        """The same exception class in this process when it is one of ours (a core's refusal,
        e.g. `AdmissionError`); anything else is a `CoreFailure`: the core has a bug."""
        known = by_name(self.kind)
        if known is not None and known is not CoreFailure:
            return known(f"core {core}: {self.message}")
        return CoreFailure(f"core {core} failed: {self.kind}: {self.message}")


@dataclass(frozen=True)
class Reply:
    id: int
    value: object = None
    error: ErrorReport | None = None


@dataclass(frozen=True)
class Ready:
    """The first thing a core sends: it is serving."""

    core: int
    kernels: str  # the reduce-kernel backend it chose
    fallbacks: tuple[str, ...] = field(default=())  # what it gave up here, and why


# ---- the core's lifecycle, as the supervisor sees it ------------------------------------------

class CoreState(Enum):
    """A data-plane core's state in the supervisor. Transitions: see supervisor.py's table."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPED = "stopped"
