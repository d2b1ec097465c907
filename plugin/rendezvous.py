"""How a worker registers its job with an appliance and learns where to send segments.

`POST /v1/jobs` with the job's name and world size is idempotent: the first rank creates the job,
the others get the same answer (job id, secret cookie, one endpoint per data-plane core, the
multicast group results come back on, the segment size). All ranks of a job must agree on the
name, the world size and the mode; the appliance refuses a mismatch with 409.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.registration import JobDescription, SchemaError

from .session import Endpoint

__all__ = ["JobInfo", "RendezvousError", "leave", "register"]

# The appliance sits on the data network: never send its API traffic to an HTTP proxy that
# the environment may name.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RendezvousError(ReductionError):
    """The appliance's API could not be reached or refused the job; the message says which."""


@dataclass(frozen=True)
class JobInfo:
    appliance: str
    job_id: int
    cookie: int
    world_size: int
    endpoints: tuple[Endpoint, ...]
    segment_bytes: int
    multicast: tuple[str, int] | None
    deterministic: bool
    token: str | None = None


def _call(appliance: str, method: str, path: str, body: dict[str, object] | None,
          token: str | None, timeout_s: float) -> object:
    request = urllib.request.Request(
        f"http://{appliance}{path}", data=json.dumps(body).encode() if body else None,
        method=method,
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})},
    )
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            reply: object = json.loads(response.read())
            return reply
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise RendezvousError(f"appliance {appliance} refused {method} {path}: "
                              f"{exc.code} {detail}") from exc
    except (OSError, ValueError) as exc:
        raise RendezvousError(f"cannot reach appliance API at {appliance}: {exc}") from exc


def register(
    appliance: str,
    name: str,
    world_size: int,
    *,
    rank: int | None = None,
    deterministic: bool = False,
    multicast: bool = True,
    token: str | None = None,
    timeout_s: float = 10.0,
) -> JobInfo:
    """Register (or look up) job `name` at `appliance` ("host:port" of its API), and join it
    as `rank` when given. `token` is the appliance's API token, if it requires one."""
    reply = _call(appliance, "POST", "/v1/jobs", {
        "name": name, "world_size": world_size, "deterministic": deterministic,
        "multicast": multicast,
    }, token, timeout_s)
    info = parse_job(appliance, reply, token)
    if rank is not None:
        _call(appliance, "POST", f"/v1/jobs/{info.job_id}/join", {"rank": rank}, token,
              timeout_s)
    return info


def leave(info: JobInfo, rank: int, timeout_s: float = 5.0) -> None:
    """Tell the appliance this rank is done; the last rank's leave frees the job's slots."""
    _call(info.appliance, "POST", f"/v1/jobs/{info.job_id}/leave", {"rank": rank}, info.token,
          timeout_s)


def parse_job(appliance: str, reply: object, token: str | None = None) -> JobInfo:
    """A worker's view of its job from the registration answer (`dataplane.registration`)."""
    try:
        job = JobDescription.from_json(reply)
    except SchemaError as exc:
        raise RendezvousError(f"appliance {appliance} sent a malformed job reply: {exc}") from exc
    if job.cookie is None:
        raise RendezvousError(f"appliance {appliance} sent job {job.job_id} without its cookie")
    endpoints = tuple(
        Endpoint((e.host, e.port), job.job_id, job.cookie, e.slots,
                 f"appliance {appliance} core {e.core}")
        for e in job.endpoints)
    return JobInfo(appliance, job.job_id, job.cookie, job.world_size, endpoints,
                   job.segment_bytes, job.multicast, job.deterministic, token)
