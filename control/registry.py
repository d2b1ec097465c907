"""Job table: decides, never does. Requests and clock readings in; plans, states and refusals
out. The daemon applies the decisions (tells the data-plane cores, answers the API).

Credentials: the API token admits a tenant to the API at all. A job has a join secret, chosen
by its creator (or made up here and returned to the creator once); only its holder may join,
leave or resync the job, and only a join answers with the job's cookie. Listing jobs or
registering the same spec again never reveals either.

Ranks are bound to endpoints: a rank joins from one address and port, and the cores accept its
contributions from there only. A second join of a rank that is joined is refused, naming both
endpoints, unless it says `rejoin` (a restarted worker): then the old endpoint is retired and
the job moves to a new epoch, so every rank starts its slots afresh (the restarted rank's rounds
count from 1 again, and so do the others'). A rank that joins again after leaving also starts
a new epoch. `resync` asks for a new epoch explicitly (ranks that diverged); it names the epoch
it saw, so that every rank asking at once moves the job by one epoch only.

Job states and the events that move them (anything else raises `IllegalTransition`)::

    state     event        -> state     note
    --------  -----------  ---------  ------------------------------------------------------
    (none)    create       CREATED    admitted: slots and held buffers fit the core budgets
    CREATED   create       CREATED    same name and spec: idempotent, every rank registers
    ACTIVE    create       ACTIVE     idem
    CREATED   join         CREATED    a rank joined; not all yet
    CREATED   join (last)  ACTIVE     every rank has joined
    CREATED   join (late)  (refused)  registered after its run's abort, joined first by a rank
                                      that run never saw: JobGone (aborts.py); withdraw_late
                                      then aborts the job, nobody having joined it
    ACTIVE    join         ACTIVE     a rank re-joins (restarted worker): new epoch
    CREATED   resync       CREATED    new epoch
    ACTIVE    resync       ACTIVE     new epoch
    CREATED   leave        CREATED    ... while another rank is still joined
    ACTIVE    leave        ACTIVE     idem
    CREATED   leave (last) DONE       nobody is left joined: the job is removed (a registrant
    ACTIVE    leave (last) DONE       withdrawing, ranks that left before the rest came, or
                                      the job's normal end)
    CREATED   abort        ABORTED    operator, shutdown, or a rank that cannot go on (its
                                      path too narrow); workers are told why, job removed
    ACTIVE    abort        ABORTED
    CREATED   idle         EVICTED    no datagram for jobs.idle_timeout_s, or every joined
    ACTIVE    idle         EVICTED    rank silent for twice jobs.liveness_timeout_s; removed

Eviction is for jobs nobody is left to end: live workers heartbeat ten times per liveness
timeout whether they reduce or not, so a job of live workers in a long pause (an evaluation
pass, a checkpoint) stays, and one whose processes exited without leaving (a crash, Ctrl-C, a
script that never destroyed its process group) frees its slots within seconds.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field, fields, replace
from enum import Enum

from reduction_appliance.dataplane.errors import (
    AdmissionError,
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    RankHeld,
)
from reduction_appliance.dataplane.registration import JOB_NAME
from reduction_appliance.dataplane.roce import ROCE_GROUP_PORT
from reduction_appliance.dataplane.slots import holdable_buffers
from reduction_appliance.dataplane.spec import Address, JobSpec
from reduction_appliance.dataplane.verbs import ChunkTag

from .aborts import Aborted, AbortMemory
from .config import ApplianceConfig
from .jobplan import JobPlan, JobRequest, JobState

__all__ = [
    "EVICTION_CAUSES",
    "MOST_RANKS",
    "ConflictError",
    "Eviction",
    "Heard",
    "IllegalTransition",
    "JobEvent",
    "JobGone",
    "JobPlan",
    "JobRequest",
    "JobState",
    "Registry",
    "UnknownJob",
]

MOST_RANKS = 4096  # the largest job admitted (its world_size)
_EPOCHS = 1 << 16  # the header's epoch field is 16 bits: epochs wrap, compared for equality


class ConflictError(Conflict):
    """A job of that name exists with a different spec: the ranks disagree. Fix the callers."""


class UnknownJob(NotFound):
    """No job with that id (never created, or already removed)."""


class JobGone(UnknownJob):
    """The job was aborted, and the request comes after: a late rank of its run, or a request
    naming its id (control/aborts.py). The message says why it was aborted."""

    status = 410


class IllegalTransition(Conflict):
    """The event does not apply to the job's state (see the table in registry.py)."""


class JobEvent(Enum):
    JOIN = "join"
    RESYNC = "resync"
    LEAVE = "leave"
    ABORT = "abort"
    IDLE = "idle"
    UNICAST = "unicast"  # a rank hears none of the job's multicast results


_TRANSITIONS: dict[tuple[JobState, JobEvent], JobState] = {
    (JobState.CREATED, JobEvent.JOIN): JobState.CREATED,  # ACTIVE when the last rank joins
    (JobState.ACTIVE, JobEvent.JOIN): JobState.ACTIVE,
    (JobState.CREATED, JobEvent.RESYNC): JobState.CREATED,
    (JobState.ACTIVE, JobEvent.RESYNC): JobState.ACTIVE,
    (JobState.CREATED, JobEvent.LEAVE): JobState.CREATED,  # DONE when nobody is left joined
    (JobState.ACTIVE, JobEvent.LEAVE): JobState.ACTIVE,  # idem
    (JobState.CREATED, JobEvent.ABORT): JobState.ABORTED,
    (JobState.ACTIVE, JobEvent.ABORT): JobState.ABORTED,
    (JobState.CREATED, JobEvent.IDLE): JobState.EVICTED,
    (JobState.ACTIVE, JobEvent.IDLE): JobState.EVICTED,
    (JobState.CREATED, JobEvent.UNICAST): JobState.CREATED,
    (JobState.ACTIVE, JobEvent.UNICAST): JobState.ACTIVE,
}
GONE = frozenset({JobState.DONE, JobState.ABORTED, JobState.EVICTED})


@dataclass(frozen=True)
class Heard:
    """What the cores last heard of one job, as ages at the registry's clock reading."""

    quiet_s: float | None = None  # since any datagram from any rank, heartbeats included
    silent: dict[int, float] = field(default_factory=dict)  # silent joined rank -> seconds


@dataclass(frozen=True)
class Eviction:
    plan: JobPlan  # state EVICTED
    cause: str  # one of EVICTION_CAUSES
    reason: str  # for the log


#: idle: nothing heard from any rank for jobs.idle_timeout_s; abandoned: every joined rank
#: silent for twice the liveness timeout.
EVICTION_CAUSES = ("idle", "abandoned")


def _same_secret(given: str, secret: str) -> bool:
    return hmac.compare_digest(given.encode(), secret.encode())


class Registry:
    """Every job of the appliance. Not thread-safe: the daemon serialises calls."""

    def __init__(self, cfg: ApplianceConfig, *, multicast: bool = True) -> None:
        """`multicast` False: this host cannot route to the groups (a fallback the daemon
        decided and logged), so every job fans its results out by unicast."""
        self.cfg = cfg
        self.multicast = multicast and cfg.multicast.enabled
        self._by_id: dict[int, JobPlan] = {}
        self._next_id = 1
        self._aborted = AbortMemory(cfg.jobs.deadline_s)
        groups = cfg.multicast.groups
        # Skip the range's first address: 239.x.0.0 style addresses confuse some switches.
        count = min(groups.num_addresses, 65536)
        self._groups = [str(groups.network_address + i) for i in range(1, count)]

    # ---- queries ----
    @property
    def jobs(self) -> list[JobPlan]:
        return list(self._by_id.values())

    def find(self, name: str) -> JobPlan | None:
        return next((p for p in self._by_id.values() if p.name == name), None)

    def get(self, job_id: int) -> JobPlan:
        plan = self._by_id.get(job_id)
        if plan is None:
            gone = self._aborted.of_id(job_id)
            raise UnknownJob(f"no job {job_id}") if gone is None else JobGone(gone.told())
        return plan

    def slots_in_use(self) -> int:
        return sum(p.spec.slots for p in self._by_id.values())

    def held_buffers_reserved(self) -> int:
        return sum(p.spec.hold_buffers for p in self._by_id.values())

    # ---- decisions ----
    def plan(self, request: JobRequest, cookie: int, secret: str, now: float) -> JobPlan:
        """Admit `request` with join secret `secret` (a plan to apply, then `commit`), return
        the existing plan when the same job registers again, or raise: `BadRequest` for an
        impossible request, `ConflictError` for another spec under the same name, `Forbidden`
        for the right spec with the wrong secret, `AdmissionError` naming the budget exceeded.
        `secret` empty means the caller has none (another rank): the existing job is returned
        and the caller learns nothing secret from it."""
        if not JOB_NAME.fullmatch(request.name):
            raise BadRequest(
                f"job name {request.name[:64]!r}: 1..128 characters of letters, digits and "
                "._:@+=- (they appear in status, metrics and logs)")
        if not 1 <= request.world_size <= MOST_RANKS:
            raise BadRequest(f"world_size must be 1..{MOST_RANKS}, got {request.world_size}")
        existing = self.find(request.name)
        if existing is not None:
            if existing.request != request:
                differ = ", ".join(
                    f"{f.name} {getattr(existing.request, f.name)!r} (this request: "
                    f"{getattr(request, f.name)!r})" for f in fields(JobRequest)
                    if getattr(existing.request, f.name) != getattr(request, f.name))
                raise ConflictError(
                    f"job {request.name!r} exists with {differ}: every rank must register it "
                    "alike; another job needs another name")
            if secret and not _same_secret(secret, existing.secret):
                raise Forbidden(
                    f"job {request.name!r} exists and that is not its join secret: another run "
                    "may have this name (each run needs a job name of its own), or this rank "
                    "was given another secret than its peers")
            return existing
        if not secret:
            raise BadRequest("creating a job needs its join secret (the API makes one up "
                             "when the request has none)")
        dp = self.cfg.dataplane
        slots = request.slots or self.cfg.jobs.slots
        if slots < 1:
            raise BadRequest(f"slots must be >= 1 per core, got {slots}")
        if request.transport not in ("udp", "roce"):
            raise BadRequest(f"transport must be udp or roce, got {request.transport!r}")
        if request.transport == "roce" and request.multicast and slots > ChunkTag.SLOTS:
            raise BadRequest(f"a RoCE job with multicast results has at most {ChunkTag.SLOTS} "
                             f"slots per core (a chunk's immediate names its slot), not {slots}")
        if request.transport == "roce" and not self.cfg.roce.enabled:
            raise BadRequest("this appliance has no RDMA device (config [roce] device): "
                             "create the job with transport udp")
        capacity = self.cfg.slot_capacity
        free = capacity - self.slots_in_use()
        if slots > free:
            need_mib = slots * self.cfg.slot_pair_bytes / 2**20
            raise AdmissionError(
                f"job {request.name!r} needs {slots} slot pairs per core ({need_mib:.1f} MiB), "
                f"but only {free} of {capacity} are free (slot memory budget "
                f"{dp.slot_memory_mb} MiB per core, {len(self._by_id)} jobs admitted)"
            )
        hold = self.cfg.jobs.hold_buffers if request.deterministic else 0
        holdable = holdable_buffers(dp.rx_buffers)
        unreserved = holdable - self.held_buffers_reserved()
        if hold > unreserved:
            raise AdmissionError(
                f"deterministic job {request.name!r} needs {hold} receive buffers per core to "
                f"hold early ranks' contributions (jobs.hold_buffers), but only {unreserved} of "
                f"{holdable} are unreserved (dataplane.rx_buffers = {dp.rx_buffers})")
        job_id = self._next_id
        multicast = None
        wanted = request.multicast if request.multicast is not None else (
            request.transport == "udp")
        if wanted and self.multicast:
            group = self._groups[(job_id - 1) % len(self._groups)]
            # A RoCE job's group travels as UD (its port marks it for the core's RoCE half).
            multicast = (group, self.cfg.multicast.port if request.transport == "udp"
                         else ROCE_GROUP_PORT)
        spec = JobSpec(job_id, cookie, request.world_size, slots, request.deterministic,
                       multicast, hold_buffers=hold,
                       liveness_timeout=self.cfg.jobs.liveness_timeout_s)
        late_for = self._aborted.of_run(request, now)
        if late_for is not None and not _same_secret(secret, late_for.secret):
            late_for = None  # another run of the same name
        return JobPlan(request.name, request, spec, now, secret, late_for=late_for)

    def commit(self, plan: JobPlan) -> None:
        """Record a plan the data plane accepted."""
        self._by_id[plan.spec.job_id] = plan
        self._next_id = max(self._next_id, plan.spec.job_id + 1)

    def check_secret(self, job_id: int, secret: str) -> JobPlan:
        """The job, when `secret` is its join secret (else `Forbidden`) and it is not gone."""
        plan = self.get(job_id)
        if not _same_secret(secret, plan.secret):
            raise Forbidden(f"that is not the join secret of job {job_id}")
        if plan.state in GONE:
            raise IllegalTransition(f"job {job_id} is {plan.state.value}")
        return plan

    def _move(self, job_id: int, event: JobEvent, secret: str | None = None) -> JobPlan:
        plan = self.get(job_id)
        if secret is not None and not _same_secret(secret, plan.secret):
            raise Forbidden(f"that is not the join secret of job {job_id}")
        target = _TRANSITIONS.get((plan.state, event))
        if target is None:
            raise IllegalTransition(f"job {job_id} is {plan.state.value}: cannot {event.value}")
        return replace(plan, state=target)

    def join(self, job_id: int, rank: int, secret: str, endpoint: Address,
             rejoin: bool = False, silent_s: float = 0.0, lanes: int = 1,
             window_cap: int | None = None) -> JobPlan:
        """Bind `rank` to `endpoint`. A rank joined now is refused unless `rejoin`, or unless
        the endpoint it joined from has been silent (`silent_s`, as the cores heard it) for the
        liveness timeout: dead by the rule every rank goes by, so its successor (a restarted
        worker that cannot say `rejoin`, e.g. under torchrun) takes its place. A rank that
        joined before (now or earlier) starts a new epoch. `lanes`: how the rank splits the
        job's slots (plugin/pipeline.py); every rank must split them alike, or each round
        waits in other slots for its peers until the deadline, so another number than the
        other joined ranks' is refused. `window_cap`: what the rank said its host's receive
        buffer holds, for the status."""
        plan = self._move(job_id, JobEvent.JOIN, secret)
        spec = plan.spec
        if not 0 <= rank < spec.world_size:
            raise BadRequest(f"rank {rank} outside world size {spec.world_size}")
        if plan.late_for is not None:
            if rank not in plan.late_for.seen:
                raise JobGone(
                    f"rank {rank} came after its run had ended: {plan.late_for.told()} before "
                    f"this rank joined it. Job {job_id}, which this rank registered after the "
                    "abort, is withdrawn; a new run of that name needs another join secret")
            plan = replace(plan, late_for=None)  # a rank of that run again: it was restarted
        others = sorted(plan.joined - {rank})
        if others and lanes != plan.lanes:
            raise Conflict(
                f"rank {rank} of job {job_id} splits its slots into {lanes} lane(s), the "
                f"joined rank(s) {others} into {plan.lanes}: every rank of a job must use the "
                "same number (REDUCTION_LANES, or ApplianceClient's lanes=)")
        current = spec.endpoints[rank]
        if rank in plan.joined and current == endpoint and not rejoin:
            return plan  # the same join again (its answer was lost): nothing changes
        liveness = self.cfg.jobs.liveness_timeout_s
        if rank in plan.joined and not rejoin and silent_s < liveness:
            where = "" if current is None else f" from {current[0]}:{current[1]}"
            raise RankHeld(
                f"rank {rank} of job {job_id} is already joined{where}; {endpoint[0]}:"
                f"{endpoint[1]} cannot join as rank {rank} too (a restarted worker re-joins "
                "with rejoin=true, which retires the old endpoint, or joins again once the old "
                f"endpoint has been silent for the liveness timeout, {liveness:g} s)",
                retry_after_s=round(liveness - silent_s, 3))
        endpoints = list(spec.endpoints)
        endpoints[rank] = endpoint
        epoch = spec.epoch
        if rank in plan.seen:
            epoch = spec.epoch % (_EPOCHS - 1) + 1  # 1..65535, never 0
        joined = plan.joined | {rank}
        state = JobState.ACTIVE if len(joined) == spec.world_size else plan.state
        held = {r: w for r, w in plan.windows_held.items() if r != rank}
        if window_cap is not None:
            held[rank] = window_cap
        plan = replace(plan, spec=replace(spec, endpoints=tuple(endpoints), epoch=epoch,
                                          departed=spec.departed - {rank}),
                       joined=joined, seen=plan.seen | {rank}, state=state, lanes=lanes,
                       windows_held=held)
        self._by_id[job_id] = plan
        return plan

    def resync(self, job_id: int, secret: str, seen_epoch: int) -> JobPlan:
        """A new epoch, if the job is still at `seen_epoch` (the ranks asking together move it
        once); returns the job either way."""
        plan = self._move(job_id, JobEvent.RESYNC, secret)
        if plan.spec.epoch == seen_epoch:
            epoch = plan.spec.epoch % (_EPOCHS - 1) + 1
            plan = replace(plan, spec=replace(plan.spec, epoch=epoch))
        self._by_id[job_id] = plan
        return plan

    def unicast_results(self, job_id: int, rank: int, secret: str) -> JobPlan:
        """The job's results by unicast fan-out from now on: joined `rank` hears none of its
        multicast group (the network does not deliver it: a switch with IGMP snooping and no
        querier). Every rank then gets each result from the core itself; a job already
        unicast is returned as it is. Only a UDP job multicasts this way (409 otherwise)."""
        plan = self._move(job_id, JobEvent.UNICAST, secret)
        if rank not in plan.joined:
            raise Conflict(f"rank {rank} has not joined job {job_id}")
        if plan.request.transport != "udp":
            raise Conflict(f"job {job_id} is a {plan.request.transport} job: its results are "
                           "not UDP multicast")
        plan = replace(plan, spec=replace(plan.spec, multicast=None))
        self._by_id[job_id] = plan
        return plan

    def new_epoch(self, job_id: int) -> JobPlan:
        """A new epoch the appliance itself needs (a data-plane core restarted empty)."""
        plan = self._move(job_id, JobEvent.RESYNC)
        plan = replace(plan, spec=replace(plan.spec, epoch=plan.spec.epoch % (_EPOCHS - 1) + 1))
        self._by_id[job_id] = plan
        return plan

    def leave(self, job_id: int, rank: int, secret: str) -> JobPlan:
        """A rank is done (or, never joined, withdraws its registration). Returns the plan;
        state DONE means remove the job now: nobody is left joined. A job some of whose ranks
        never came ends too when those that did have left: no round of it can complete, and
        kept, it held its slots and its name (a new secret refused with 403) for
        jobs.idle_timeout_s, since eviction of an abandoned job counts joined ranks only."""
        plan = self._move(job_id, JobEvent.LEAVE, secret)
        joined = plan.joined - {rank}
        state = JobState.DONE if not joined else plan.state
        departed = plan.spec.departed | ({rank} & plan.joined)  # (its peers are told so)
        plan = replace(plan, spec=replace(plan.spec, departed=departed), joined=joined,
                       state=state, windows_held={r: w for r, w in plan.windows_held.items()
                                                  if r != rank})
        self._record(plan)
        return plan

    def abort(self, job_id: int, rank: int | None = None, secret: str | None = None, *,
              reason: str = "", now: float | None = None) -> JobPlan:
        """Remove the job: an operator's abort, or with `rank` and `secret` one of its ranks'
        (one that found the job cannot go on: a path narrower than its datagrams). With `now`
        (the registry clock), the job is remembered, with the `reason` its ranks were told,
        for those that come late (control/aborts.py)."""
        plan = self._move(job_id, JobEvent.ABORT, secret)
        if rank is not None and not 0 <= rank < plan.spec.world_size:
            raise BadRequest(f"rank {rank} outside world size {plan.spec.world_size}")
        self._record(plan)
        if now is not None:
            self._remember(plan, reason, now)
        return plan

    def withdraw_late(self, job_id: int, now: float) -> JobPlan | None:
        """Remove the job a late rank of an aborted run registered (its join was refused with
        `JobGone`), where no rank joined it: nobody else will. None where it stays."""
        plan = self._by_id.get(job_id)
        if plan is None or plan.late_for is None or plan.joined:
            return None
        gone = self._move(job_id, JobEvent.ABORT)
        self._record(gone)
        self._remember(plan, f"registered after {plan.late_for.told()}, by a late rank of that "
                       "run", now, as_run=False)
        return gone

    def _remember(self, plan: JobPlan, reason: str, now: float, *, as_run: bool = True) -> None:
        self._aborted.remember(Aborted(plan.spec.job_id, plan.request, plan.secret, plan.seen,
                                       reason, now), as_run=as_run)

    def evict(self, job_id: int) -> JobPlan:
        """Remove a job nobody is left to end, now (a new registration of its name found it
        abandoned: see `Appliance.create_job`)."""
        plan = self._move(job_id, JobEvent.IDLE)
        self._record(plan)
        return plan

    def idle(self, heard: dict[int, Heard], now: float) -> list[Eviction]:
        """Jobs to evict (see the module docstring): nothing heard from any rank for
        jobs.idle_timeout_s (never a word: since admission), or every joined rank silent for
        twice the liveness timeout. `heard` maps job id -> what its cores heard; a job left out
        (the daemon leaves out those a core did not answer for: restarting, or too busy) waits
        for the next pass."""
        limit = self.cfg.jobs.idle_timeout_s
        abandoned_after = 2 * self.cfg.jobs.liveness_timeout_s
        evicted = []
        for job_id, plan in list(self._by_id.items()):
            word = heard.get(job_id)
            if word is None:
                continue
            quiet = now - plan.created
            if word.quiet_s is not None:
                quiet = min(quiet, word.quiet_s)
            silences = [word.silent.get(rank, 0.0) for rank in plan.joined]
            if quiet >= limit:
                cause, reason = "idle", f"no datagram from any rank for {quiet:.0f} s"
            elif silences and min(silences) >= abandoned_after:
                cause, reason = "abandoned", (
                    f"every joined rank silent for {min(silences):.0f} s: the workers are gone "
                    "(alive, they heartbeat)")
            else:
                continue
            gone = self._move(job_id, JobEvent.IDLE)
            self._record(gone)
            evicted.append(Eviction(gone, cause, reason))
        return evicted

    def _record(self, plan: JobPlan) -> None:
        if plan.state in GONE:
            del self._by_id[plan.spec.job_id]
        else:
            self._by_id[plan.spec.job_id] = plan
