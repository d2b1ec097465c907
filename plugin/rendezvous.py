"""How a worker registers its job with an appliance, joins it, and learns where to send segments.

    job = register(appliance, name, world_size, secret=s)   # every rank; idempotent
    job = join(job, rank, endpoint)                         # the client does this itself

`POST /v1/jobs` with the job's name and world size creates the job or finds it. The ranks of a
job share its join secret (chosen by its creator, or made up by the appliance and returned to
the creator): the training framework hands it to the others (the torch backend uses its c10d
store). `join` binds this rank to the UDP endpoint it sends from and returns the cookie and the
job's epoch; the appliance accepts this rank's datagrams from that endpoint only. A restarted
worker joins with `rejoin=True`, which retires its old endpoint and starts a new epoch. All
ranks of a job must agree on the name, the world size and the mode; the appliance refuses a
mismatch with 409, a wrong secret with 403.

The answers follow `dataplane.registration`, the schema the appliance writes them with.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, replace

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.registration import EndpointInfo, JobDescription, SchemaError

from .session import Address, Endpoint

__all__ = ["JobInfo", "RendezvousError", "join", "leave", "register", "resync"]

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

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """One per appliance core, for the sessions (needs the cookie: join first)."""
        if self.cookie is None:
            raise RendezvousError(f"job {self.job_id} at {self.appliance} is not joined yet")
        return tuple(Endpoint((c.host, c.port), self.job_id, self.cookie, c.slots,
                              f"appliance {self.appliance} core {c.core}")
                     for c in self.cores)


def _call(appliance: str, method: str, path: str, body: dict[str, object] | None,
          token: str | None, timeout_s: float) -> JobDescription:
    request = urllib.request.Request(
        f"http://{appliance}{path}", data=json.dumps(body).encode() if body else None,
        method=method,
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})},
    )
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            reply: object = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise RendezvousError(f"appliance {appliance} refused {method} {path}: "
                              f"{exc.code} {detail}") from exc
    except (OSError, ValueError) as exc:
        raise RendezvousError(f"cannot reach appliance API at {appliance}: {exc}") from exc
    try:
        return JobDescription.from_json(reply)
    except SchemaError as exc:
        raise RendezvousError(f"appliance {appliance} sent a malformed job reply: {exc}") from exc


def _info(appliance: str, job: JobDescription, secret: str | None,
          token: str | None) -> JobInfo:
    return JobInfo(appliance, job.job_id, job.name, job.world_size, job.segment_bytes,
                   job.multicast, job.deterministic, job.deadline_s, job.endpoints,
                   secret=job.secret or secret, token=token, cookie=job.cookie,
                   epoch=job.epoch)


def register(
    appliance: str,
    name: str,
    world_size: int,
    *,
    secret: str | None = None,
    deterministic: bool = False,
    multicast: bool = True,
    token: str | None = None,
    timeout_s: float = 10.0,
) -> JobInfo:
    """Register (or look up) job `name` at `appliance` ("host:port" of its API). `secret` is
    the job's join secret; without one, the creator gets a fresh one (`JobInfo.secret`) to hand
    to the other ranks. `token` is the appliance's API token, if it requires one."""
    body: dict[str, object] = {"name": name, "world_size": world_size,
                               "deterministic": deterministic, "multicast": multicast}
    if secret:
        body["secret"] = secret
    return _info(appliance, _call(appliance, "POST", "/v1/jobs", body, token, timeout_s),
                 secret, token)


def join(info: JobInfo, rank: int, endpoint: Address, *, rejoin: bool = False,
         timeout_s: float = 10.0) -> JobInfo:
    """Join as `rank`, sending from `endpoint`; the answer carries the cookie and epoch."""
    if not info.secret:
        raise RendezvousError(f"joining job {info.name!r} needs its join secret (from the rank "
                              "that created it)")
    job = _call(info.appliance, "POST", f"/v1/jobs/{info.job_id}/join",
                {"rank": rank, "secret": info.secret, "address": endpoint[0],
                 "port": endpoint[1], "rejoin": rejoin}, info.token, timeout_s)
    if job.cookie is None:
        raise RendezvousError(f"appliance {info.appliance} answered the join of job "
                              f"{info.job_id} without its cookie")
    return replace(info, cookie=job.cookie, epoch=job.epoch)


def resync(info: JobInfo, seen_epoch: int, timeout_s: float = 10.0) -> JobInfo:
    """Ask for a new epoch (ranks that diverged); the job moves once whoever asks first."""
    job = _call(info.appliance, "POST", f"/v1/jobs/{info.job_id}/resync",
                {"secret": info.secret or "", "epoch": seen_epoch}, info.token, timeout_s)
    return replace(info, epoch=job.epoch)


def leave(info: JobInfo, rank: int, timeout_s: float = 5.0) -> None:
    """Tell the appliance this rank is done; the last rank's leave frees the job's slots."""
    _call(info.appliance, "POST", f"/v1/jobs/{info.job_id}/leave",
          {"rank": rank, "secret": info.secret or ""}, info.token, timeout_s)
