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

from dataplane.errors import ReductionError

from .session import Endpoint

__all__ = ["JobInfo", "RendezvousError", "register"]

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


def register(
    appliance: str,
    name: str,
    world_size: int,
    *,
    deterministic: bool = False,
    multicast: bool = True,
    token: str | None = None,
    timeout_s: float = 10.0,
) -> JobInfo:
    """Register (or look up) job `name` at `appliance` ("host:port" of its API)."""
    body = json.dumps({
        "name": name, "world_size": world_size, "deterministic": deterministic,
        "multicast": multicast,
    }).encode()
    request = urllib.request.Request(
        f"http://{appliance}/v1/jobs", data=body, method="POST",
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {token}"} if token else {})},
    )
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise RendezvousError(f"appliance {appliance} refused job {name!r}: "
                              f"{exc.code} {detail}") from exc
    except (OSError, ValueError) as exc:
        raise RendezvousError(f"cannot reach appliance API at {appliance}: {exc}") from exc
    return parse_job(appliance, reply)


def parse_job(appliance: str, reply: dict[str, object]) -> JobInfo:
    try:
        job_id = int(reply["job_id"])  # type: ignore[call-overload]
        cookie = int(reply["cookie"])  # type: ignore[call-overload]
        endpoints = tuple(
            Endpoint((str(e["host"]), int(e["port"])), job_id, cookie, int(e["slots"]),
                     f"appliance {appliance} core {e['core']}")
            for e in reply["endpoints"]  # type: ignore[attr-defined]
        )
        mc = reply.get("multicast")
        multicast = (str(mc["group"]), int(mc["port"])) if mc else None  # type: ignore[index]
        return JobInfo(
            appliance, job_id, cookie, int(reply["world_size"]),  # type: ignore[call-overload]
            endpoints, int(reply["segment_bytes"]), multicast,  # type: ignore[call-overload]
            bool(reply["deterministic"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"appliance {appliance} sent a malformed job reply: {exc}") from exc
