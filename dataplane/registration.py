"""The registration answer: what the appliance's API tells a worker about its job.

One schema, shared by the two ends like the wire format: the registry builds a
`JobDescription` and the API sends `to_json()`; a worker's rendezvous parses the reply with
`from_json`, which checks every field's type and names the first one that is wrong. The cookie
is present only in answers to the job's own ranks (None in listings).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .errors import PeerError
from .wire import VERSION

__all__ = ["JOB_NAME", "JOB_NAME_CHARS", "JOB_NAME_MAX", "EndpointInfo", "JobDescription",
           "SchemaError"]

# What a job may be called (the appliance refuses anything else; workers derive names within
# it): printable, no spaces or control characters, no quoting trouble.
JOB_NAME_CHARS = "A-Za-z0-9._:@+="  # and "-"
JOB_NAME_MAX = 128
JOB_NAME = re.compile(rf"[A-Za-z0-9][{JOB_NAME_CHARS}-]{{0,{JOB_NAME_MAX - 1}}}")

T = TypeVar("T")


class SchemaError(PeerError):
    """A registration answer that does not follow the schema (the appliance's fault)."""


def _field(data: dict[str, Any], key: str, kind: type[T], where: str) -> T:
    if key not in data:
        raise SchemaError(f"{where}: missing {key!r}")
    value = data[key]
    # bool is an int in Python, never in our schema
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)  # type: ignore[return-value]
        raise SchemaError(f"{where}: {key!r} should be {kind.__name__}, got {value!r}")
    return value


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class EndpointInfo:
    """One data-plane core of the appliance: where to send segments, and the job's slots."""

    core: int
    host: str
    port: int
    slots: int

    def to_json(self) -> dict[str, object]:
        return {"core": self.core, "host": self.host, "port": self.port, "slots": self.slots}

    @classmethod
    def from_json(cls, value: object, where: str = "endpoint") -> EndpointInfo:
        data = _object(value, where)
        return cls(_field(data, "core", int, where), _field(data, "host", str, where),
                   _field(data, "port", int, where), _field(data, "slots", int, where))


@dataclass(frozen=True)
class JobDescription:
    name: str
    job_id: int
    cookie: int | None  # only for the job's own ranks
    world_size: int
    deterministic: bool
    segment_bytes: int
    state: str
    joined: tuple[int, ...]
    deadline_s: float  # advised: an allreduce unfinished by then fails
    endpoints: tuple[EndpointInfo, ...]
    multicast: tuple[str, int] | None  # the group results come back on
    epoch: int = 1  # the job's current epoch (rounds and slot uses count from its start)
    liveness_s: float = 5.0  # a rank or appliance silent this long is declared dead
    secret: str | None = None  # the join secret: only in the answer that created the job
    # The datagram format the appliance's cores speak (an appliance from before the field
    # spoke 2): a worker of another version would be dropped as malformed, so it refuses.
    wire_version: int = VERSION
    transport: str = "udp"  # "roce": ranks connect queue pairs (`/connect`) before joining
    # advised: a completer's round trip above this shrinks the windows (0: fixed windows)
    queue_target_s: float = 0.0

    def public(self) -> JobDescription:
        """The description without the cookie or the secret, for listings."""
        return replace(self, cookie=None, secret=None)

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name, "job_id": self.job_id, "cookie": self.cookie,
            "world_size": self.world_size, "deterministic": self.deterministic,
            "segment_bytes": self.segment_bytes, "state": self.state,
            "joined": list(self.joined), "deadline_s": self.deadline_s,
            "endpoints": [e.to_json() for e in self.endpoints],
            "multicast": (None if self.multicast is None
                          else {"group": self.multicast[0], "port": self.multicast[1]}),
            "epoch": self.epoch, "secret": self.secret, "liveness_s": self.liveness_s,
            "wire_version": self.wire_version, "transport": self.transport,
            "queue_target_s": self.queue_target_s,
        }

    @functools.cached_property
    def encoded(self) -> bytes:
        """`to_json` as the API sends it, encoded once: the ranks whose joins or leaves one
        core update carried share one answer (control/specbatch.py), and at 4096 ranks its
        `joined` list alone took 0.6 ms to encode."""
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_json(cls, value: object) -> JobDescription:
        where = "job"
        data = _object(value, where)
        cookie = data.get("cookie")
        if cookie is not None and (not isinstance(cookie, int) or isinstance(cookie, bool)):
            raise SchemaError(f"{where}: 'cookie' should be int or null, got {cookie!r}")
        joined = _field(data, "joined", list, where)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in joined):
            raise SchemaError(f"{where}: 'joined' should list ranks, got {joined!r}")
        endpoints = tuple(EndpointInfo.from_json(e, f"{where}.endpoints[{i}]")
                          for i, e in enumerate(_field(data, "endpoints", list, where)))
        if not endpoints:
            raise SchemaError(f"{where}: no endpoints")
        secret = data.get("secret")
        if secret is not None and not isinstance(secret, str):
            raise SchemaError(f"{where}: 'secret' should be str or null, got {secret!r}")
        mc = data.get("multicast")
        multicast = None
        if mc is not None:
            group = _object(mc, f"{where}.multicast")
            multicast = (_field(group, "group", str, f"{where}.multicast"),
                         _field(group, "port", int, f"{where}.multicast"))
        return cls(
            name=_field(data, "name", str, where), job_id=_field(data, "job_id", int, where),
            cookie=cookie, world_size=_field(data, "world_size", int, where),
            deterministic=_field(data, "deterministic", bool, where),
            segment_bytes=_field(data, "segment_bytes", int, where),
            state=_field(data, "state", str, where), joined=tuple(joined),
            deadline_s=_field(data, "deadline_s", float, where), endpoints=endpoints,
            multicast=multicast, epoch=_field(data, "epoch", int, where), secret=secret,
            liveness_s=_field(data, "liveness_s", float, where),
            wire_version=_field(data, "wire_version", int, where) if "wire_version" in data else 2,
            transport=_field(data, "transport", str, where) if "transport" in data else "udp",
            queue_target_s=(_field(data, "queue_target_s", float, where)
                            if "queue_target_s" in data else 0.0),
        )
