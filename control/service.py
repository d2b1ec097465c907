"""The appliance as a service: applies the registry's decisions to the data plane, and assembles
snapshots for status and metrics. The HTTP layer (api.py) only parses and answers."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from reduction_appliance.dataplane.counters import Counter
from reduction_appliance.dataplane.errors import (
    AdmissionError,
    BadRequest,
    Conflict,
    Forbidden,
    ReductionError,
    RequestError,
    Unavailable,
)
from reduction_appliance.dataplane.registration import JobDescription
from reduction_appliance.dataplane.roce import ROCE_PORTS
from reduction_appliance.dataplane.spec import Address
from reduction_appliance.dataplane.wire import HEADER_SIZE

from . import bodies
from .activity import Activity, merged
from .drain import Drain, overdue
from .registry import (
    EVICTION_CAUSES,
    ConflictError,
    Eviction,
    Heard,
    JobGone,
    JobPlan,
    JobState,
    Registry,
    UnknownJob,
)
from .snapshot import ApplianceSnapshot, CoreSnapshot, InterfaceSnapshot, job_snapshot
from .specbatch import SpecBatches
from .supervisor import Supervisor

__all__ = ["VERSION", "Appliance", "Draining"]

VERSION = "0.1.0"
_log = logging.getLogger("reductiond")


class Draining(Unavailable):
    """The appliance is shutting down and takes no new jobs."""


class Appliance:
    """Registry (decides) + supervisor (applies): decisions serialised by one lock, and
    updates of the cores, in the order they were decided, by a second (`_to_cores`)."""

    def __init__(
        self,
        registry: Registry,
        supervisor: Supervisor,
        *,
        network_view: Callable[[], tuple[tuple[InterfaceSnapshot, ...], tuple[str, ...],
                                         tuple[str, ...], tuple[str, ...]]] | None = None,
    ) -> None:
        self.registry = registry
        self.supervisor = supervisor
        self.started = time.monotonic()
        self.draining = False
        self.janitor_errors = 0  # the daemon's periodic chores that failed (each logged)
        self.api_abandoned: Callable[[], int] = lambda: 0  # the API server's count (daemon.py)
        self.evicted = dict.fromkeys(EVICTION_CAUSES, 0)  # jobs evicted since start, by cause
        self.aborted = {"operator": 0, "rank": 0}  # jobs aborted since start, by whom
        self.late_refused = 0  # joins of ranks that came after their job's abort
        self._lock = threading.Lock()
        # Held by whoever changes a job on the cores, from taking the job as the registry has
        # it (under _lock) until the cores have it: they get a job's specs, and its removal,
        # in the order they were taken. Taken after _lock, never before it.
        self._to_cores = threading.Lock()
        self._updates: SpecBatches[JobPlan] = SpecBatches(self._lock, self._to_cores)
        self._last_answer: tuple[JobPlan, bool, JobDescription] | None = None
        # core index -> (monotonic time, packets in, bytes in) at the last sample, and rates
        self._samples: dict[int, tuple[float, int, int]] = {}
        self._rates: dict[int, tuple[float, float]] = {}
        # interfaces, steering rules, steering notes, RDMA devices: read by the daemon's caller
        self._network_view = network_view
        self._roce_ports: dict[tuple[int, int], tuple[str, int]] = {}  # (job, rank) -> address

    @property
    def cfg(self) -> Any:
        return self.registry.cfg

    # ---- job lifecycle ----
    def create_job(self, body: dict[str, Any]) -> JobDescription:
        """Register a job (idempotent). Its creator gets the join secret in the answer when it
        did not choose one; nobody gets the cookie here (see `join`)."""
        request = bodies.parse_request(body)
        given = bodies.string(body, "secret", required=False)
        with self._lock:
            if self.draining:
                raise Draining("the appliance is shutting down; it takes no new jobs")
            exists = self.registry.find(request.name) is not None
            secret = given or ("" if exists else secrets.token_urlsafe(24))
            try:
                plan = self.registry.plan(request, cookie=secrets.randbits(64), secret=secret,
                                          now=time.monotonic())
            except (ConflictError, Forbidden) as refused:
                # Another spec or secret under a taken name: a launcher that restarted the
                # job's workers (a new secret, maybe a new world size) finds the old job. Its
                # workers gone, the name is theirs to take; soon gone, they may ask again.
                if not self._free_name_of_abandoned(request.name, refused):
                    raise
                exists = False
                secret = given or secrets.token_urlsafe(24)
                plan = self.registry.plan(request, cookie=secrets.randbits(64), secret=secret,
                                          now=time.monotonic())
            if not exists:
                self.supervisor.add_job(plan.spec)
                self.registry.commit(plan)
        answer = plan.describe(self.cfg)
        created_for_them = not exists and not given
        return replace(answer, secret=plan.secret) if created_for_them else answer

    def join(self, job_id: int, body: dict[str, Any]) -> JobDescription:
        """Bind a rank to the endpoint it will send from; the answer carries the cookie."""
        rank = bodies.integer(body, "rank")
        secret = bodies.string(body, "secret")
        endpoint = (bodies.address(body, "address"), bodies.integer(body, "port", 1, 65535))
        rejoin = bodies.boolean(body, "rejoin")
        lanes = bodies.integer(body, "lanes", 1, 1 << 16, default=1)
        window_cap = (bodies.integer(body, "window_cap", 1, 1 << 16)
                      if body.get("window_cap") is not None else None)
        with self._lock:
            try:
                self.registry.join(job_id, rank, secret, endpoint, rejoin,
                                   silent_s=self._silent_elsewhere(job_id, rank, endpoint),
                                   lanes=lanes, window_cap=window_cap)
            except JobGone as late:  # a rank of an aborted run, after the abort
                self.late_refused += 1
                _log.info("refused rank %d's join of job %d: %s", rank, job_id, late)
                self._withdraw_late(job_id)
                raise
            ticket = self._updates.decided(job_id)
        # The cores learn it with the changes decided meanwhile (control/specbatch.py); the
        # answer is the job as they have it.
        return self._answer(self._sent(job_id, ticket), member=True)

    def _sent(self, job_id: int, ticket: int) -> JobPlan:
        """The job as the cores have it, once they have change `ticket` (the lock not held)."""
        return self._updates.await_sent(job_id, ticket, lambda: self.registry.get(job_id),
                                        lambda plan: self.supervisor.update_job(plan.spec))

    def _answer(self, plan: JobPlan, *, member: bool) -> JobDescription:
        """`plan` described, once for all the calls one core update answers (and encoded once:
        `JobDescription.encoded`). A race between two threads describes it twice."""
        last = self._last_answer
        if last is None or last[0] is not plan or last[1] != member:
            last = self._last_answer = (plan, member, plan.describe(self.cfg, member=member))
        return last[2]

    def _update_cores(self, plan: JobPlan) -> None:
        """Every core gets the job's spec (the lock held), after any push still on its way."""
        with self._to_cores:
            self.supervisor.update_job(plan.spec)
            self._updates.sent(plan.spec.job_id, plan)

    def _withdraw_late(self, job_id: int) -> None:
        """The job a late rank of an aborted run made, gone with its refusal (the lock held)."""
        gone = self.registry.withdraw_late(job_id, time.monotonic())
        if gone is not None:
            self._remove_from_cores(job_id)
            self._release_roce(job_id)
            _log.info("withdrew job %d (%s): a late rank of an aborted run registered it",
                      job_id, gone.name)

    def _remove_from_cores(self, job_id: int, *, abort: str | None = None) -> None:
        """The cores drop the job (the lock held), after any push of it still on its way."""
        with self._to_cores:
            self.supervisor.remove_job(job_id, abort=abort)

    def _free_name_of_abandoned(self, name: str, refused: RequestError) -> bool:
        """Whether the job called `name` was abandoned and is now evicted: ranks joined, and
        none heard for the liveness timeout (as every core says). Where none was heard for a
        fifth of it (every rank's heartbeats missed twice), `refused` is given the time left to
        ask again in; a live job's refusal stands as it is."""
        existing = self.registry.find(name)
        if existing is None or not existing.joined:
            return False  # never joined: perhaps registered ahead of its workers
        word = self._heard(*self._job_activity_of((existing.spec.job_id,)))
        if word is None or word.quiet_s is None:
            return False
        quiet = word.quiet_s
        liveness = self.cfg.jobs.liveness_timeout_s
        if quiet < liveness:
            if quiet >= 0.2 * liveness:
                refused.retry_after_s = round(liveness - quiet, 3)
            return False
        gone = self.registry.evict(existing.spec.job_id)
        self.evicted["abandoned"] += 1
        self._remove_from_cores(gone.spec.job_id, abort=(
            f"evicted: its name was registered again, every rank silent for {quiet:.0f} s"))
        self._release_roce(gone.spec.job_id)
        _log.info("evicted job %d (%s): registered again, every rank silent for %.0f s",
                  gone.spec.job_id, gone.name, quiet)
        return True

    def _silent_elsewhere(self, job_id: int, rank: int, endpoint: Address) -> float:
        """How long the cores have not heard `rank` at the endpoint it joined from, when it
        joined from another one (else 0: the cores are asked only when it decides a join; and
        0 unless every core answered, as for eviction)."""
        with contextlib.suppress(ReductionError):  # no such job: join says so
            plan = self.registry.get(job_id)
            if rank in plan.joined and plan.spec.endpoints[rank] not in (None, endpoint):
                word = self._heard(*self._job_activity_of((job_id,)))
                if word is not None:
                    return word.silent.get(rank, 0.0)
        return 0.0

    def _heard(self, act: Activity) -> Heard | None:
        """What the cores heard of one job, when every core answered for it: heartbeats go to
        one core per appliance, so without that core's word (restarting, or too busy) another
        core alone would read live workers as silent."""
        if act.reports != len(self.supervisor.cores):
            return None
        return Heard(act.quiet_s, act.silent)

    def connect(self, job_id: int, body: dict[str, Any]) -> dict[str, object]:
        """A rank's RDMA queue pairs (one per core) for a RoCE job: the cores connect theirs
        and answer with their ends, and the address the rank then joins with (its IP and a
        port from `ROCE_PORTS` that names its queue pairs on every core)."""
        rank = bodies.integer(body, "rank")
        secret = bodies.string(body, "secret")
        ip = bodies.address(body, "address")
        remotes = body.get("queue_pairs")
        if not isinstance(remotes, list) or not all(isinstance(r, dict) for r in remotes):
            raise BadRequest("queue_pairs must be a list of queue-pair endpoints, one per core")
        with self._lock:
            plan = self.registry.get(job_id)
            if plan.request.transport != "roce":
                raise Conflict(f"job {job_id} runs over {plan.request.transport}, not roce")
            self.registry.check_secret(job_id, secret)
            if not 0 <= rank < plan.spec.world_size:
                raise BadRequest(f"rank {rank} is outside world size {plan.spec.world_size}")
            bodies.check_landings(remotes, plan.spec.slots,
                                  HEADER_SIZE + self.cfg.roce.segment_bytes)
            address = self._roce_address(job_id, rank, ip)
            try:
                cores = self.supervisor.accept_queue_pairs(remotes, address)
            except ValueError as exc:  # a malformed endpoint: the caller's
                raise BadRequest(str(exc)) from exc
        return {"address": list(address), "queue_pairs": cores}

    def _roce_address(self, job_id: int, rank: int, ip: str) -> tuple[str, int]:
        """The rank's address on every core: the same port again for a rank that reconnects
        (its old queue pairs are replaced), else the lowest free one."""
        old = self._roce_ports.get((job_id, rank))
        if old is not None and old[0] == ip:
            return old
        used = {port for _, port in self._roce_ports.values()}
        port = next((p for p in ROCE_PORTS if p not in used), None)
        if port is None:
            raise AdmissionError(f"every one of the {len(ROCE_PORTS)} RoCE addresses is in use")
        if old is not None:
            self.supervisor.release_queue_pairs((old,))
        self._roce_ports[(job_id, rank)] = (ip, port)
        return ip, port

    def _release_roce(self, job_id: int) -> None:
        """The job has gone: its ranks' queue pairs go too (lock held)."""
        gone = tuple(a for (j, _), a in self._roce_ports.items() if j == job_id)
        if gone:
            self._roce_ports = {k: a for k, a in self._roce_ports.items() if k[0] != job_id}
            self.supervisor.release_queue_pairs(gone)

    def resync(self, job_id: int, body: dict[str, Any]) -> JobDescription:
        """A new epoch for ranks that diverged (once, however many ask from `epoch`)."""
        secret = bodies.string(body, "secret")
        seen = bodies.integer(body, "epoch", 0, 65535)
        with self._lock:
            before = self.registry.get(job_id).spec
            plan = self.registry.resync(job_id, secret, seen)
            # Every rank asks after an outage: the first moves the epoch, and the others
            # wait for the cores to have it (`pending`), not send it again.
            ticket = (self._updates.decided(job_id) if plan.spec != before
                      else self._updates.pending(job_id))
        if ticket is not None:
            plan = self._sent(job_id, ticket)
        return self._answer(plan, member=True)

    def unicast(self, job_id: int, body: dict[str, Any]) -> JobDescription:
        """A rank hears none (or few) of the job's multicast results: every rank gets them by
        unicast fan-out from now on (logged once, at WARNING: the network needs fixing)."""
        rank = bodies.integer(body, "rank")
        secret = bodies.string(body, "secret")
        with self._lock:
            before = self.registry.get(job_id).spec
            plan = self.registry.unicast_results(job_id, rank, secret)
            if plan.spec != before:
                self._update_cores(plan)
                assert before.multicast is not None
                group, port = before.multicast
                _log.warning("job %d (%s): rank %d hears none of the results multicast to "
                             "%s:%d, or few; results by unicast fan-out to every rank from now "
                             "on. The data network does not deliver the group, or its "
                             "full-size datagrams, to that host (a switch with IGMP snooping "
                             "and no querier? a multicast route of a smaller MTU?): see "
                             "deploy/host-tuning.md", job_id, plan.name, rank, group, port)
        return plan.describe(self.cfg, member=True)

    def leave(self, job_id: int, body: dict[str, Any]) -> JobDescription:
        rank = bodies.integer(body, "rank")
        secret = bodies.string(body, "secret")
        with self._lock:
            before = self.registry.get(job_id).spec
            plan = self.registry.leave(job_id, rank, secret)
            if plan.state is JobState.DONE:
                self._remove_from_cores(job_id)
                self._release_roce(job_id)
                return plan.describe(self.cfg)
            if plan.spec == before:
                return plan.describe(self.cfg)
            ticket = self._updates.decided(job_id)
        # The cores tell its peers it left, not went quiet: sent with the leaves decided
        # meanwhile, unless the last of them ended the job first (then there is no one to tell).
        try:
            return self._answer(self._sent(job_id, ticket), member=False)
        except UnknownJob:
            return plan.describe(self.cfg)

    def core_restarted(self, core: int) -> None:
        """A data-plane core came back empty: every job moves to a new epoch (its workers hear
        RESYNC and carry on; a round that had results fails with a clear error)."""
        with self._lock:
            for plan in self.registry.jobs:
                moved = self.registry.new_epoch(plan.spec.job_id)
                with contextlib.suppress(ReductionError):  # a core that died again catches up
                    self._update_cores(moved)

    def abort(self, job_id: int, body: dict[str, Any] | None = None) -> JobDescription:
        """Remove the job; its workers are told (ABORTED) and fail at once, saying why. With a
        `body` ({"rank", "secret", "reason"}) one of its ranks aborts it: a rank that found
        the job cannot go on tells its peers why at once, where a leave would only say that
        it left."""
        why = f"an operator's abort: reductionctl abort {job_id} or DELETE /v1/jobs/{job_id}"
        rank = secret = None
        if body:  # (an operator's may be empty: {})
            rank = bodies.integer(body, "rank")
            secret = bodies.string(body, "secret")
            why = f"at rank {rank}'s request: {bodies.text(body, 'reason')}"
        with self._lock:
            plan = self.registry.abort(job_id, rank, secret, reason=why, now=time.monotonic())
            self._remove_from_cores(job_id, abort=why)
            self._release_roce(job_id)
            self.aborted["operator" if rank is None else "rank"] += 1
        _log.info("aborted job %d (%s): %s", job_id, plan.name, why)
        return plan.describe(self.cfg)

    def job(self, job_id: int) -> JobDescription:
        """One job as listings show it (no cookie)."""
        with self._lock:
            return self.registry.get(job_id).describe(self.cfg).public()

    def jobs(self) -> list[JobDescription]:
        """Every job, as one snapshot taken under the lock (no cookies)."""
        with self._lock:
            return [p.describe(self.cfg).public() for p in self.registry.jobs]

    def evict_idle(self) -> list[Eviction]:
        """Remove the jobs nobody is left to end (`Registry.idle`); their workers, if any
        still listen, are told."""
        with self._lock:
            ids = self._job_ids()
        # The cores are asked without the lock: a busy core takes its time to answer, and joins
        # and leaves wait for nobody meanwhile (a rack's job leaving: 16% of the daemon's time
        # went here). A job some core did not answer for waits for the next pass.
        heard = {act.job_id: word for act in self._job_activity_of(ids)
                 if (word := self._heard(act)) is not None}
        with self._lock:
            evicted = self.registry.idle(heard, time.monotonic())
            for gone in evicted:
                self.evicted[gone.cause] += 1
                self._remove_from_cores(gone.plan.spec.job_id,
                                        abort=f"evicted: {gone.reason}")
                self._release_roce(gone.plan.spec.job_id)
        return evicted

    def shutdown(self, grace_s: float) -> None:
        """Stop taking jobs; let every job finish the rounds it has begun and begin no later
        one (`control.drain`), then tell its workers the appliance is going away: each rank
        then has every round up to the fence, and fails the next before any of its results
        reached its tensor. A job whose begun rounds do not finish within `grace_s` (a rank
        stopped) is told all the same."""
        with self._lock:
            self.draining = True
            drain = Drain(tuple(p.spec.job_id for p in self.registry.jobs))
        deadline = time.monotonic() + grace_s
        while drain.pending:
            with self._lock:
                drained = drain.take(self.supervisor.fence(drain.floors(), drain.ended()))
                for job_id, done in drained.items():
                    self._end(job_id, done.why())
            if time.monotonic() >= deadline:
                break
            if drain.pending:
                time.sleep(0.05)  # the cores' next word on the rounds left
        left = drain.pending
        with self._lock:
            for plan in self.registry.jobs:
                self._end(plan.spec.job_id, overdue(left.get(plan.spec.job_id, 0), grace_s))

    def _end(self, job_id: int, why: str) -> None:
        if any(p.spec.job_id == job_id for p in self.registry.jobs):  # (not evicted meanwhile)
            self.registry.abort(job_id)
            self._remove_from_cores(job_id, abort=why)

    def probe_cores(self) -> None:
        """Called about once a second: a core that does not answer is killed and restarted."""
        self.supervisor.probe()

    def sample_rates(self) -> None:
        """Called about once a second: receive rates per core for status."""
        now = time.monotonic()
        for core in self.supervisor.cores:
            packets = core.counters[Counter.PACKETS_IN]
            nbytes = core.counters[Counter.BYTES_IN]
            before = self._samples.get(core.config.index)
            if before is not None and now > before[0]:
                dt = now - before[0]
                self._rates[core.config.index] = ((packets - before[1]) / dt,
                                                  (nbytes - before[2]) / dt)
            self._samples[core.config.index] = (now, packets, nbytes)

    # ---- views ----
    def _job_ids(self) -> tuple[int, ...]:
        return tuple(p.spec.job_id for p in self.registry.jobs)

    def _job_activity_of(self, ids: tuple[int, ...]) -> list[Activity]:
        return merged(ids, self.supervisor.stats(ids) if ids else [])

    def snapshot(self) -> ApplianceSnapshot:
        now = time.monotonic()
        with self._lock:
            plans = {p.spec.job_id: p for p in self.registry.jobs}
        activity = self._job_activity_of(tuple(plans))  # (the cores asked without the lock)
        jobs = []
        for act in activity:
            jobs.append(job_snapshot(plans[act.job_id], act, now, tuple(
                f"{time.strftime('%H:%M:%S', time.localtime(d.at))} {d.why}"
                for d in self.supervisor.disruptions.get(act.job_id, []))))
        cores = []
        queue_pairs = self.supervisor.queue_pairs() if self.cfg.roce.enabled else []
        for core in self.supervisor.cores:
            counters = core.counters.snapshot()
            loops = counters.get("poll_loops", 0)
            cores.append(CoreSnapshot(
                index=core.config.index,
                pid=core.process.pid if core.process is not None else None,
                cpu=core.config.cpu, port=core.config.bind[1], state=core.state.value,
                kernels=core.kernels, last_exit=core.last_exit,
                restarts=core.restarts, counters=counters,
                busy_fraction=core.counters[Counter.POLL_BUSY_LOOPS] / loops if loops else 0.0,
                packets_per_s=self._rates.get(core.config.index, (0.0, 0.0))[0],
                bytes_per_s=self._rates.get(core.config.index, (0.0, 0.0))[1],
                queue_pairs=tuple(queue_pairs[core.config.index]) if queue_pairs else (),
            ))
        interfaces: tuple[InterfaceSnapshot, ...] = ()
        rules: tuple[str, ...] = ()
        notes: tuple[str, ...] = ()
        rdma: tuple[str, ...] = ()
        if self._network_view is not None:
            interfaces, rules, notes, rdma = self._network_view()
        return ApplianceSnapshot(
            version=VERSION, uptime_s=now - self.started, config=self.cfg.source,
            cores=tuple(cores), jobs=tuple(jobs), interfaces=interfaces, steering=rules,
            steering_notes=notes, rdma_devices=rdma,
            fallbacks=self.supervisor.fallbacks.describe(),
            janitor_errors=self.janitor_errors + self.supervisor.errors,
            api_requests_abandoned=self.api_abandoned(),
            jobs_evicted=dict(self.evicted), jobs_aborted=dict(self.aborted),
            late_ranks_refused=self.late_refused,
            segment_bytes=self.cfg.dataplane.max_payload,
            segment_origin=self.cfg.dataplane.segment_origin,
        )
