"""Why an appliance went silent, as a worker can find out: its API asked at the moment.

`ApplianceSilent` says only that no datagram came from an appliance for the liveness timeout;
the likeliest causes on a new rack then look alike from the worker: the appliance died, a
firewall drops the UDP datagrams one way (ufw and firewalld refuse incoming datagrams by
default, and opening the API's TCP port does not open the data ports), or the appliance no
longer has the job (it restarted). The appliance's API tells them apart: does it answer, does
it have the job, and when did its cores last hear this rank. `explained` adds that verdict to
each such error (one question per appliance per call); the verdict itself (`verdict`) is a
pure function of the answer, tested with plain dictionaries.

A restarted appliance need not wait for the silence: its core answers a heartbeat of a job it
lacks with UNKNOWN_JOB, and `job_gone` asks the API whether the job is really gone (a core
being restarted lacks its jobs for a moment too) and says why.

Nor need a dead one: an appliance silent for one and a half heartbeats while a round waits on
it is overdue (plugin.hearing), and `ended` tries a TCP connection to its API. Refused, the
appliance's host is up and no reductiond runs there (it crashed, was killed or stopped): its
cores and jobs went with it, and the rounds fail for good with `ApplianceEnded` about a second
after its end. Connected, or no answer (a host that is down, a network outage): the timeout
decides as before.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from reduction_appliance.dataplane.errors import (
    AllreduceTimeout,
    ApplianceEnded,
    ApplianceSilent,
    JobAborted,
    ReductionError,
)
from reduction_appliance.dataplane.units import format_ranks
from reduction_appliance.dataplane.wire import Header

from . import rendezvous
from .pipeline import Outcome
from .rendezvous import JobInfo

__all__ = ["Diagnosis", "verdict"]

Ask = Callable[[JobInfo], object]
#: refuses((address, port)): whether a TCP connection to an API there is refused
Refuses = Callable[[tuple[str, int]], bool]
_log = logging.getLogger(__name__)


class Diagnosis:
    """Tells `ApplianceSilent` errors what the silent appliances' APIs say, and
    `AllreduceTimeout` errors which ranks never joined, asking each API at most once per its
    liveness timeout for each: a caller that retries at once after each failure (the verdict
    stands: later rounds fail at once too) asks once, not per call."""

    EXPLAINS = (ApplianceSilent, AllreduceTimeout)  # the errors `explained` may add to

    def __init__(self, ask: Ask = rendezvous.appliance_status,
                 clock: Callable[[], float] = time.monotonic,
                 refuses: Refuses = rendezvous.api_refuses) -> None:
        self._ask = ask
        self._refuses = refuses
        self._clock = clock
        # "silent <appliance>" or "missing <appliance>" -> (when asked, what it said)
        self._said: dict[str, tuple[float, str]] = {}
        self._check_at: dict[str, float] = {}  # appliance -> when to ask if it has the job
        self._warned = False  # `warn_missing` spoke, or found every rank joined

    def explained(self, outcomes: list[Outcome], jobs: list[JobInfo],
                  rank: int) -> list[Outcome]:
        """`outcomes` with each `ApplianceSilent` told why, where the API can say."""
        out = []
        for outcome in outcomes:
            error = outcome.error
            if type(error) is ApplianceSilent:
                text = str(error)
                notes = [self._verdict(info, rank) for info in jobs
                         if info.transport == "udp" and f"appliance {info.appliance} " in text]
                if notes:
                    outcome = replace(outcome,
                                      error=ApplianceSilent(f"{text}. {' '.join(notes)}"))
            elif type(error) is AllreduceTimeout:
                missing = self._missing_notes(jobs)
                if missing:
                    outcome = replace(outcome, error=AllreduceTimeout(f"{error}. {missing}"))
            out.append(outcome)
        return out

    def warn_missing(self, jobs: list[JobInfo], rank: int, stalled_s: float) -> None:
        """Once a round has had no result for the liveness timeout, log once (WARNING) which
        ranks have not joined, where some have not: its deadline (60 s by default) is far, and
        an operator watching a job hang at its first allreduce should know where to look."""
        if self._warned or not jobs or stalled_s < min(j.liveness_s for j in jobs):
            return
        self._warned = True
        notes = self._missing_notes(jobs)
        if notes:
            _log.warning("rank %d's allreduce has had no result for %.1f s. %s", rank,
                         stalled_s, notes)

    def _missing_notes(self, jobs: list[JobInfo]) -> str:
        """What each appliance's API says of ranks that never joined ("" where none)."""
        return " ".join(note for note in (self._cached(self._missing, info, "missing")
                                          for info in jobs) if note)

    def _cached(self, ask: Callable[[JobInfo], str], info: JobInfo, what: str) -> str:
        """`ask(info)`, asked again only once `info`'s liveness timeout has passed."""
        now = self._clock()
        key = f"{what} {info.appliance}"
        said = self._said.get(key)
        if said is None or now - said[0] >= info.liveness_s:
            said = (now, ask(info))
            self._said[key] = said
        return said[1]

    def _missing(self, info: JobInfo) -> str:
        """The ranks the API says have not joined the job (workers that never started, or
        failed before they joined), or nothing: a round cannot finish without them, and its
        timeout names them only as ranks the appliance still waits for."""
        try:
            status = self._ask(info)
        except ReductionError:
            return ""
        job = _job(status, info.job_id, info.name)
        joined = job.get("joined") if job is not None else None
        if not isinstance(joined, list):
            return ""
        seen = set(joined)
        missing = [r for r in range(info.world_size) if r not in seen]
        if not missing:
            return ""
        created = job.get("created_s") if job is not None else None
        ago = f", registered {created:.0f} s ago" if isinstance(created, (int, float)) else ""
        listed = format_ranks(missing, 16)
        ranks = f"rank {listed} has" if len(missing) == 1 else f"ranks {listed} have"
        return (f"The appliance at {info.appliance} says {ranks} not joined job "
                f"{info.job_id} ('{info.name}'){ago}: the worker never started there, or "
                "failed before it joined (look at that host's launcher and log)")

    def job_gone(self, info: JobInfo, h: Header, rank: int, joined_at: float
                 ) -> JobAborted | None:
        """What to fail the job's rounds with, now that a core of `info`'s appliance answered
        this rank's heartbeat with UNKNOWN_JOB (`h`): the API is asked (at most once per
        liveness timeout while it answers, once per heartbeat while it does not) and, where it
        lists no such job, the error says why. None where the notice is not about this job,
        or the API still lists the job (a core being restarted gets its jobs back) or does not
        answer (the liveness timeout will tell)."""
        if h.job_id != info.job_id or h.cookie != info.cookie:
            return None
        now = self._clock()
        if now < self._check_at.get(info.appliance, -math.inf):
            return None
        self._check_at[info.appliance] = now + info.liveness_s
        try:
            status = self._ask(info)
        except ReductionError:
            # A restarted daemon's cores answer before its API listens: ask again at the next
            # heartbeat's answer, not a whole timeout later (a refusal is final at once).
            self._check_at[info.appliance] = now + info.liveness_s / 10
            return None
        if not isinstance(status, dict) or _job(status, info.job_id, info.name) is not None:
            return None
        uptime = status.get("uptime_s")
        job = f"job {info.job_id} ('{info.name}')"
        if isinstance(uptime, (int, float)) and uptime < now - joined_at:
            why = (f"the appliance at {info.appliance} restarted {uptime:.1f} s ago, after "
                   f"rank {rank} joined, and lost {job} with it")
        else:
            why = (f"the appliance at {info.appliance} no longer has {job}: it was aborted, "
                   "evicted or left, and the appliance has forgotten it")
        return JobAborted(f"{why}; register the job again (a launcher that restarts its "
                          "workers, such as torchrun --max-restarts, does). Its core answered "
                          "this rank's heartbeat that it has no such job, and its API lists "
                          "none")

    def ended(self, info: JobInfo, api: tuple[str, int] | None, quiet_s: float,
              rank: int) -> ApplianceEnded | None:
        """What to fail the job's rounds with, now that `info`'s appliance, its API at `api`
        (resolved: `rendezvous.api_endpoint`; None where it did not resolve) has sent nothing
        for `quiet_s` while a round of `rank` waited on it: `ApplianceEnded` where its API
        refuses a connection (no daemon runs there), else None (it runs, or its host or the
        network is down: the liveness timeout will tell)."""
        if api is None or not self._refuses(api):
            return None
        return ApplianceEnded(
            f"appliance {info.appliance} has sent nothing for {quiet_s:.1f} s while a round of "
            f"rank {rank} waited on it, and its host refuses a connection to its API: no "
            "reductiond runs there (it crashed, was killed, or was stopped), and job "
            f"{info.job_id} ('{info.name}') went with it. Its log says why (journalctl -u "
            "reductiond); once it runs again, register the job again (a launcher that "
            "restarts its workers, such as torchrun --max-restarts, does)")

    def _verdict(self, info: JobInfo, rank: int) -> str:
        return self._cached(lambda i: self._asked(i, rank), info, "silent")

    def _asked(self, info: JobInfo, rank: int) -> str:
        asked_at = self._clock()
        try:
            answer = self._ask(info)
        except ReductionError as exc:
            return verdict(info, rank, None, str(exc))
        return verdict(info, rank, answer, took_s=self._clock() - asked_at)


# An API that answers this late lost packets on the way (TCP resends a lost SYN after 1 s):
# the network to the appliance was down when the datagrams stopped.
SLOW_ANSWER_S = 1.0


def verdict(info: JobInfo, rank: int, status: object, unreachable: str = "",
            took_s: float = 0.0) -> str:
    """What `status` (the appliance's `GET /v1/status`, which took `took_s` to come; None: it
    did not answer, `unreachable` says how) says about why its datagrams stopped reaching this
    rank."""
    api = f"Its API at {info.appliance}"
    if status is None:
        return (f"{api} does not answer either ({unreachable}): the appliance is down, or "
                "the network to it")
    job = _job(status, info.job_id, info.name)
    if job is None:
        return (f"{api} answers but has no job {info.job_id}: the appliance restarted, or the "
                "job was aborted or evicted (register the job again)")
    heard = _number(job.get("heard_s"), rank)
    ports = sorted({c.port for c in info.cores})
    data = (f"{info.cores[0].host}:{ports[0]}" + (f"-{ports[-1]}" if len(ports) > 1 else "")
            if info.cores else "its data ports")
    endpoint = _entry(job.get("endpoints"), rank) or "this host"
    elsewhere = _entry(job.get("seen_elsewhere"), rank)
    if elsewhere and not (heard is not None and heard < info.liveness_s / 2):
        return (f"{api} answers, and its cores get this rank's datagrams from {elsewhere}, not "
                f"from {endpoint}, where it joined: a NAT between this host and the appliance "
                "rewrites their source, and they are dropped as a stranger's (a container on a "
                "bridged network? give it the host's network: docker run --network host)")
    if heard is not None and heard < info.liveness_s / 2 and took_s >= SLOW_ANSWER_S:
        return (f"{api} answered only after {took_s:.1f} s, and its cores hear this rank again "
                f"(the last datagram from {endpoint} {heard:.1f} s ago): the network between "
                f"was down for longer than the liveness timeout ({info.liveness_s:g} s) and "
                "is back (a link flap, a switch rebooting); a job outlives shorter outages "
                "(jobs.liveness_timeout_s on the appliance sets how long). To go on, call "
                "resync() on every rank: datagrams the outage took from every rank leave slots "
                "that no later round could use")
    if heard is not None and heard < info.liveness_s / 2:  # it hears the heartbeats
        return (f"{api} answers, and its cores hear this rank (the last datagram from "
                f"{endpoint} {heard:.1f} s ago), but nothing they send reaches this host: a "
                f"firewall here dropping UDP to {endpoint} (ufw and firewalld refuse incoming "
                "datagrams by default), or the route back")
    since = "" if heard is None else f" for {heard:.1f} s"
    return (f"{api} answers, but its cores have heard nothing from this rank ({endpoint})"
            f"{since}: its datagrams do not reach {data} (a firewall on the appliance "
            "dropping UDP to its data ports, or the route there)")


def _job(status: object, job_id: int, name: str) -> dict[str, Any] | None:
    """The job in `status`, by number and name (a restarted appliance numbers anew)."""
    jobs = status.get("jobs") if isinstance(status, dict) else None
    for job in jobs if isinstance(jobs, list) else []:
        if isinstance(job, dict) and job.get("job_id") == job_id and job.get("name") == name:
            return job
    return None


def _entry(table: object, rank: int) -> str | None:
    value = table.get(str(rank)) if isinstance(table, dict) else None
    return value if isinstance(value, str) else None


def _number(table: object, rank: int) -> float | None:
    value = table.get(str(rank)) if isinstance(table, dict) else None
    return float(value) if isinstance(value, (int, float)) else None
