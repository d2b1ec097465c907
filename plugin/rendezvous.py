"""How a worker registers its job with an appliance, joins it, and learns where to send segments.

    job = register(appliance, name, world_size, secret=s)   # every rank; idempotent
    job = join(job, rank, endpoint)                         # the client does this itself

`POST /v1/jobs` with the job's name and world size creates the job or finds it. The ranks of a
job share its join secret (chosen by its creator, or made up by the appliance and returned to
the creator): the training framework hands it to the others (the torch backend uses its c10d
store). `join` binds this rank to the UDP endpoint it sends from and returns the cookie and the
job's epoch; the appliance accepts this rank's datagrams from that endpoint only. A restarted
worker joins with `rejoin=True`, which retires its old endpoint and starts a new epoch (without
it, once the appliance has not heard the old endpoint for the liveness timeout: `join` waits
for that as the appliance's 409 says, `retry_after_s`, within its own deadline; `register`
likewise when a name's old job may be abandoned, which it then replaces). All ranks of a job
must agree on the name, the world size and the mode; the appliance refuses a mismatch with 409,
a wrong secret with 403, and a rank that joins after its peers aborted the job with 410, which
`join` raises as the `JobAborted` they got.

The answers follow `dataplane.registration`, the schema the appliance writes them with.

Every call retries what may pass on a second try (no connection, a timeout, a lost answer,
503 or another 5xx, 408 or 429) with exponential backoff until its deadline; any other refusal
(4xx) is final at once. Calls are safe to repeat: registering again finds the job, joining
again from the same endpoint changes nothing, a resync names the epoch it saw.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import random
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace

from reduction_appliance.dataplane.errors import JobAborted, ReductionError
from reduction_appliance.dataplane.registration import EndpointInfo, JobDescription, SchemaError
from reduction_appliance.dataplane.wire import VERSION

from .session import Address, Endpoint

__all__ = ["JobInfo", "RendezvousError", "api_address", "api_endpoint", "api_refuses", "connect",
           "join", "leave", "leave_quietly", "register", "resync", "unicast"]

_log = logging.getLogger(__name__)

# The appliance sits on the data network: never send its API traffic to an HTTP proxy that
# the environment may name.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RendezvousError(ReductionError):
    """The appliance's API could not be reached or refused the job; the message says which."""


@dataclass(frozen=True)
class JobInfo:
    """A job at one appliance, as a worker knows it. `cookie` is None until it joined."""

    appliance: str  # the API's host:port
    job_id: int
    name: str
    world_size: int
    segment_bytes: int
    multicast: Address | None
    deterministic: bool
    deadline_s: float
    cores: tuple[EndpointInfo, ...]
    secret: str | None = None
    token: str | None = None
    cookie: int | None = None
    epoch: int = 1
    liveness_s: float = 5.0  # a rank or appliance silent this long is declared dead
    transport: str = "udp"  # "roce": queue pairs (plugin.roce), not datagrams
    queue_target_s: float = 0.0  # the appliance's advice (plugin/congestion.py); 0: fixed windows

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """One per appliance core, for the sessions (needs the cookie: join first)."""
        if self.cookie is None:
            raise RendezvousError(f"job {self.job_id} at {self.appliance} is not joined yet")
        return tuple(Endpoint((c.host, c.port), self.job_id, self.cookie, c.slots,
                              f"appliance {self.appliance} core {c.core}")
                     for c in self.cores)


_FIRST_RETRY_S = 0.1
_MOST_BETWEEN_S = 2.0
# An attempt waits half its call's time, so that a lost answer leaves time for a second (a
# leave's 5 s used to be one attempt's, never repeated), and no less: one given up queues
# again at the back of the API's queue, and 5 s attempts of 4096 ranks joining at once gave
# up by the thousand (benchmarks-journal.md, "Joins pushed without the lock"). At most 30 s
# (a RoCE connect may take the job's deadline): the slowest queue measured took 12-22 s.
_LONGEST_ATTEMPT_S = 30.0
# Past the time a held rank frees, before asking again: the appliance counts a rank gone
# strictly after the liveness timeout, by its own clock.
_TAKEOVER_MARGIN_S = 0.25


def _call(appliance: str, method: str, path: str, body: dict[str, object] | None,
          token: str | None, timeout_s: float) -> JobDescription:
    return _job_of(appliance, _call_raw(appliance, method, path, body, token, timeout_s))


def _call_waiting(appliance: str, method: str, path: str, body: dict[str, object] | None,
                  token: str | None, timeout_s: float) -> JobDescription:
    """`_call`, asking again when the appliance says the request may pass later: a worker
    restarted by a launcher, before the appliance counts its predecessors gone, waits for that
    (live holders never go silent: refused at the deadline, saying so)."""
    began = time.monotonic()
    deadline = began + timeout_s
    while True:
        try:
            return _call(appliance, method, path, body, token,
                         max(deadline - time.monotonic(), 0.1))
        except _HeldBack as exc:
            pause = exc.retry_after_s + _TAKEOVER_MARGIN_S
            if time.monotonic() + pause >= deadline:
                raise RendezvousError(f"{exc} (still held after {time.monotonic() - began:.1f} s "
                                      f"of the {timeout_s:g} s this call may take)") from None
            time.sleep(pause)


def _job_of(appliance: str, reply: object) -> JobDescription:
    try:
        job = JobDescription.from_json(reply)
    except SchemaError as exc:
        raise RendezvousError(f"appliance {appliance} sent a malformed job reply: {exc}") from exc
    if job.wire_version != VERSION:
        raise RendezvousError(
            f"appliance {appliance} speaks datagram format v{job.wire_version}, this worker "
            f"v{VERSION}: install the same reduction-appliance release on both")
    return job


def _call_raw(appliance: str, method: str, path: str, body: dict[str, object] | None,
              token: str | None, timeout_s: float, *, unreachable_is_final: bool = False,
              gone_after_retry: bool = False) -> object:
    """The API's JSON answer, attempts repeated while it does not answer or is busy (5xx).
    `gone_after_retry`: a 404 to a repeated attempt answers None (an earlier attempt whose
    answer was lost removed the resource: what a leave asks for)."""
    deadline = time.monotonic() + timeout_s
    attempt_s = min(timeout_s / 2, _LONGEST_ATTEMPT_S)
    pause = _FIRST_RETRY_S
    attempts = 0
    while True:
        attempts += 1
        left = deadline - time.monotonic()
        try:
            reply = _attempt(appliance, method, path, body, token, min(attempt_s, max(left, 0.1)))
            break
        except _Gone:
            if gone_after_retry and attempts > 1:
                return None
            raise
        except _Retryable as exc:
            if unreachable_is_final and exc.unreachable:
                raise RendezvousError(str(exc)) from exc.__cause__
            if time.monotonic() + pause >= deadline:
                raise RendezvousError(f"{exc} (gave up after {attempts} attempts in "
                                      f"{timeout_s:g} s)") from exc.__cause__
            # Backoff between attempts at an API that did not answer, jittered: thousands of
            # ranks refused together (a full connection table) must not return together.
            time.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(pause * 2, _MOST_BETWEEN_S)
    return reply


class _Gone(RendezvousError):
    """The API answered 404: no such job (or path); or 410 (`_Aborted`)."""


class _Aborted(_Gone):
    """410: the job was aborted; the message says why."""


class _HeldBack(RendezvousError):
    """A request refused for now, with `retry_after_s`: a join whose rank an endpoint may still
    hold (the appliance's `RankHeld`), or a registration whose name a job may still hold, each
    free then if their workers stay silent."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Retryable(Exception):
    """An attempt that may pass when repeated: no answer, or the appliance is busy (5xx)."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable  # refused: nothing listens (not a 5xx, not a timeout)


def _attempt(appliance: str, method: str, path: str, body: dict[str, object] | None,
             token: str | None, timeout_s: float) -> object:
    request = urllib.request.Request(
        f"http://{appliance}{path}", data=json.dumps(body).encode() if body else None,
        method=method,
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})},
    )
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        if not _is_json(detail):  # an error page: a proxy, or another server on that port
            if exc.code in (501, 505):  # it does not serve this API at all
                raise _not_the_api(appliance, method, path, f"{exc.code} {detail}") from exc
            detail = f"{detail[:_SHOWN]!r} (not the appliance's JSON)"
        message = f"appliance {appliance} refused {method} {path}: {exc.code} {_said(detail)}"
        if exc.code == 401:  # say which end to fix
            message += (" (this worker sent the token it was given, which the appliance's "
                        "api.token_file does not hold)" if token else
                        " (this worker sent none: give it the appliance's API token, "
                        "REDUCTION_TOKEN for the torch plugin or register(token=...))")
        # The appliance busy (5xx), or too busy to read all of our request in time (408: a
        # host that stalled between head and body, or 4096 ranks joining at once) or to take
        # it (429): a second attempt may pass, and every call is safe to repeat.
        if exc.code >= 500 or exc.code in (408, 429):
            raise _Retryable(message) from exc
        if exc.code in (404, 410):
            raise (_Gone if exc.code == 404 else _Aborted)(message) from exc
        if exc.code in (403, 409):
            with contextlib.suppress(ValueError, TypeError, KeyError):  # no wait named
                raise _HeldBack(message, float(json.loads(detail)["retry_after_s"])) from exc
        raise RendezvousError(message) from exc
    except OSError as exc:  # (an HTTP connection closed early too: a busy appliance)
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        # Refused: nothing listens there (the daemon is gone). A timeout may be a busy one.
        raise _Retryable(f"cannot reach appliance API at {appliance}: {exc}",
                         unreachable=isinstance(reason, ConnectionRefusedError)) from exc
    except http.client.HTTPException as exc:  # something listens there, and speaks no HTTP
        raise _not_the_api(appliance, method, path, f"not HTTP: {exc}") from exc
    try:
        reply: object = json.loads(raw)
    except ValueError:
        raise _not_the_api(appliance, method, path, raw.decode(errors="replace")) from None
    return reply


_SHOWN = 120  # characters of a foreign answer worth quoting


def _said(detail: str) -> str:
    """The reason an API error answer gives (its "error"), else the answer as it came."""
    with contextlib.suppress(ValueError):
        answer = json.loads(detail)
        if isinstance(answer, dict) and isinstance(answer.get("error"), str):
            return str(answer["error"])
    return detail


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _not_the_api(appliance: str, method: str, path: str, answer: str) -> RendezvousError:
    """What answered at `appliance` is not an appliance's API: final, and says so."""
    return RendezvousError(
        f"{appliance} is not an appliance's API: it answered {method} {path} with "
        f"{answer[:_SHOWN]!r}. Give the worker the address of the appliance's api.listen "
        "(REDUCTION_APPLIANCE for the torch plugin)")


def api_address(given: str) -> str:
    """`given`, an appliance API's address as a user writes it, as "host:port": surrounding
    blanks, an "http://" and a trailing "/" are dropped (the forms a URL or a list after a
    comma takes). What names no port, a path or another scheme is refused at once: it would
    otherwise be asked for the whole of a call's time and fail as "cannot reach"."""
    text = given.strip()
    if text[:7].lower() == "http://":
        text = text[7:]
    text = text.rstrip("/")
    hint = ("give the host:port of the appliance's api.listen, e.g. 198.18.0.1:7070 "
            "(REDUCTION_APPLIANCE for the torch plugin)")
    if "://" in text:
        raise RendezvousError(f"{given!r} is not an appliance API address: the API speaks "
                              f"plain HTTP; {hint}")
    try:
        parts = urllib.parse.urlsplit(f"//{text}")
        port = parts.port
    except ValueError as exc:
        raise RendezvousError(f"{given!r} is not an appliance API address ({exc}): "
                              f"{hint}") from None
    if not parts.hostname or port is None or parts.path or parts.query or parts.fragment \
            or parts.username is not None or any(c.isspace() for c in text):
        raise RendezvousError(f"{given!r} is not an appliance API address: {hint}")
    return text


def _info(appliance: str, job: JobDescription, secret: str | None,
          token: str | None) -> JobInfo:
    return JobInfo(appliance, job.job_id, job.name, job.world_size, job.segment_bytes,
                   job.multicast, job.deterministic, job.deadline_s, job.endpoints,
                   secret=job.secret or secret, token=token, cookie=job.cookie,
                   epoch=job.epoch, liveness_s=job.liveness_s, transport=job.transport,
                   queue_target_s=job.queue_target_s)


def register(appliance: str, name: str, world_size: int, *, secret: str | None = None,
             deterministic: bool = False, multicast: bool | None = None,
             token: str | None = None, timeout_s: float = 30.0, transport: str = "udp",
             local_address: str = "0.0.0.0") -> JobInfo:
    """Register (or look up) job `name` at `appliance` ("host:port" of its API, or
    "http://host:port": `api_address`; the job's `appliance` is the former). `secret` is
    the job's join secret; without one, the creator gets a fresh one (`JobInfo.secret`) to hand
    to the other ranks. `token` is the appliance's API token, if it requires one. `transport`
    "roce" asks for RDMA queue pairs (every rank then needs an RDMA device: `connect`); "auto"
    asks for them when this worker has an RDMA device on `local_address` and the appliance
    serves RoCE, else takes UDP and says why once, at INFO. `multicast` None takes the
    transport's default for results: UDP multicasts them; RoCE writes each into every rank's
    landing buffer, or (True) sends it once as UD multicast chunks."""
    if transport not in ("udp", "roce", "auto"):
        raise RendezvousError(f"transport must be udp, roce or auto, not {transport!r}")
    appliance = api_address(appliance)
    if transport == "auto":
        from .roce import local_roce_unavailable  # pyverbs is imported only to ask

        why = local_roce_unavailable(local_address)
        if why is None:
            try:
                return register(appliance, name, world_size, secret=secret,
                                deterministic=deterministic, multicast=multicast, token=token,
                                timeout_s=timeout_s, transport="roce")
            except RendezvousError as exc:
                if "no RDMA device" not in str(exc):
                    raise
                why = f"appliance {appliance} serves no RoCE"
        _say_fallback_once(why)
        transport = "udp"
    body: dict[str, object] = {"name": name, "world_size": world_size,
                               "deterministic": deterministic, "transport": transport}
    if multicast is not None:  # else the transport's default: UDP yes, RoCE no
        body["multicast"] = multicast
    if secret:
        body["secret"] = secret
    return _info(appliance, _call_waiting(appliance, "POST", "/v1/jobs", body, token, timeout_s),
                 secret, token)


_FALLBACKS_SAID: set[str] = set()


def _say_fallback_once(why: str) -> None:
    if why not in _FALLBACKS_SAID:
        _FALLBACKS_SAID.add(why)
        _log.info("fallback: UDP instead of RoCE (%s)", why)


def join(info: JobInfo, rank: int, endpoint: Address, *, rejoin: bool = False,
         timeout_s: float = 30.0, lanes: int = 1, window_cap: int | None = None) -> JobInfo:
    """Join as `rank`, sending from `endpoint`, splitting the job's slots into `lanes` (alike
    on every rank: the appliance refuses another number than the joined ranks'); the answer
    carries the cookie and epoch. `window_cap`: the window per core this host's receive
    buffer holds, where fewer than the slots (plugin/hostchecks.py), for the operator's
    status."""
    if not info.secret:
        raise RendezvousError(f"joining job {info.name!r} needs its join secret (from the rank "
                              "that created it)")
    try:
        job = _call_waiting(info.appliance, "POST", f"/v1/jobs/{info.job_id}/join",
                            {"rank": rank, "secret": info.secret, "address": endpoint[0],
                             "port": endpoint[1], "rejoin": rejoin, "lanes": lanes,
                             **({} if window_cap is None else {"window_cap": window_cap})},
                            info.token, timeout_s)
    except _Aborted as exc:  # this rank came late: its peers were told the same
        raise JobAborted(str(exc)) from None
    if job.cookie is None:
        raise RendezvousError(f"appliance {info.appliance} answered the join of job "
                              f"{info.job_id} without its cookie")
    return replace(info, cookie=job.cookie, epoch=job.epoch)


def connect(info: JobInfo, rank: int, address: str, queue_pairs: list[dict[str, object]],
            timeout_s: float = 30.0, *, unreachable_is_final: bool = False
            ) -> tuple[Address, list[dict[str, object]]]:
    """A RoCE job's queue pairs: ours (one per core, `dataplane.verbs.QpEndpoint.as_json`) for
    the cores' ends, and the address to join with. Busy answers (a core restarting: 503) are
    retried until `timeout_s`; so is a refused connection, unless `unreachable_is_final` (a
    reconnecting worker: an appliance whose API is gone will not bring its cores back)."""
    try:
        reply = _call_raw(info.appliance, "POST", f"/v1/jobs/{info.job_id}/connect",
                          {"rank": rank, "secret": info.secret or "", "address": address,
                           "queue_pairs": list(queue_pairs)}, info.token, timeout_s,
                          unreachable_is_final=unreachable_is_final)
    except _Aborted as exc:  # (as `join`'s)
        raise JobAborted(str(exc)) from None
    try:
        assert isinstance(reply, dict)
        host, port = reply["address"]
        cores = reply["queue_pairs"]
        assert isinstance(host, str) and isinstance(port, int) and isinstance(cores, list)
        assert len(cores) == len(queue_pairs) and all(isinstance(c, dict) for c in cores)
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"appliance {info.appliance} sent a malformed connect reply: "
                              f"{str(reply)[:200]}") from exc
    return (host, port), cores


def resync(info: JobInfo, seen_epoch: int, timeout_s: float = 30.0) -> JobInfo:
    """Ask for a new epoch (ranks that diverged, or an outage that cut a round short on every
    rank); the job moves once whoever asks first. A refused connection is final at once."""
    job = _job_of(info.appliance, _call_raw(
        info.appliance, "POST", f"/v1/jobs/{info.job_id}/resync",
        {"secret": info.secret or "", "epoch": seen_epoch}, info.token, timeout_s,
        unreachable_is_final=True))
    return replace(info, epoch=job.epoch)


def unicast(info: JobInfo, rank: int, timeout_s: float = 5.0) -> JobInfo:
    """Ask for the job's results by unicast fan-out from now on: this rank hears none of its
    multicast group (`multicast_watch`). Every rank of the job then gets them so."""
    job = _call(info.appliance, "POST", f"/v1/jobs/{info.job_id}/unicast",
                {"rank": rank, "secret": info.secret or ""}, info.token, timeout_s)
    return replace(info, multicast=job.multicast)


def appliance_status(info: JobInfo, timeout_s: float = 3.0) -> object:
    """The appliance's status (`GET /v1/status`: its cores and jobs, what each core heard of
    each rank), for a worker asking why the appliance went silent. Nothing listening is
    final at once."""
    return _call_raw(info.appliance, "GET", "/v1/status", None, info.token, timeout_s,
                     unreachable_is_final=True)


def api_endpoint(appliance: str) -> tuple[str, int] | None:
    """The appliance's API (`host:port`) as a numeric address and port, its name resolved now
    (None where it does not parse or resolve): `api_refuses` must not wait on a name server in
    the outage it asks about."""
    parts = urllib.parse.urlsplit(f"http://{appliance}")
    try:
        host, port = parts.hostname, parts.port
        if host is None or port is None:
            return None
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (ValueError, OSError):  # (socket.gaierror too)
        return None
    return (str(found[0][4][0]), port) if found else None


def api_refuses(endpoint: tuple[str, int], timeout_s: float = 0.05) -> bool:
    """Whether a TCP connection to an appliance's API at `endpoint` (`api_endpoint`'s) is
    refused: its host answered, and nothing listens there. False where it connects, or where
    nothing answers within `timeout_s` (a host or a network that is down: no verdict). A
    connection only, not a request: the daemon's API sees a client that went away. (The
    caller's loop waits for it: a host's refusal comes within a round trip, a millisecond on a
    rack.)"""
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # (a timeout, no route: nothing certain)
        return False


def abort(info: JobInfo, rank: int, reason: str, timeout_s: float = 2.0) -> None:
    """Abort the job as `rank`, which found that it cannot go on: its peers fail at once
    with JobAborted saying `reason` (at most 256 characters; cut to fit), where a leave would
    only tell them it left. A refused connection is final at once; a job already gone is
    done."""
    reply = _call_raw(info.appliance, "POST", f"/v1/jobs/{info.job_id}/abort",
                      {"rank": rank, "secret": info.secret or "", "reason": reason[:256]},
                      info.token, timeout_s, unreachable_is_final=True, gone_after_retry=True)
    if reply is not None:
        _job_of(info.appliance, reply)


def leave(info: JobInfo, rank: int, timeout_s: float = 10.0) -> None:
    """Tell the appliance this rank is done; the last rank's leave frees the job's slots.
    Where an attempt's answer is lost (a busy appliance) and the repeated attempt finds the
    job gone, the first attempt was the last rank's leave, which removed it: done. A refused
    connection is final at once: nothing listens, and the job went with the daemon (a worker
    shutting down then need not wait out `timeout_s`)."""
    reply = _call_raw(info.appliance, "POST", f"/v1/jobs/{info.job_id}/leave",
                      {"rank": rank, "secret": info.secret or ""}, info.token, timeout_s,
                      unreachable_is_final=True, gone_after_retry=True)
    if reply is not None:
        _job_of(info.appliance, reply)  # (checked as every job reply is)


def leave_quietly(jobs: list[JobInfo], rank: int, timeout_s: float = 10.0) -> None:
    """`leave` each job, best effort: a worker on its way out (or withdrawing after a failed
    start) has a first error to report, and a job already gone or an appliance not answering
    is left as it is."""
    for info in jobs:
        with contextlib.suppress(ReductionError):
            leave(info, rank, timeout_s)
