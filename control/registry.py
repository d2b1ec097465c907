"""Job table: decides, never does. Values in (requests), values out (plans and refusals).

This is the seed of the job lifecycle; the control-plane work grows it (join/leave/abort,
admission against the slot budget, idle eviction). State table::

    (none)  --create(name, world, mode)-->  ACTIVE
    ACTIVE  --create(same name, same spec)--> ACTIVE  (idempotent: every rank registers)
    ACTIVE  --create(same name, other spec)--> refused (409)
    ACTIVE  --remove-->  (none)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from dataplane.aggregator import JobSpec
from dataplane.errors import AdmissionError

from .config import ApplianceConfig

__all__ = ["ConflictError", "JobPlan", "JobRequest", "Registry"]


class ConflictError(AdmissionError):
    """A job of that name exists with a different spec: the ranks disagree. Fix the callers."""


@dataclass(frozen=True)
class JobRequest:
    name: str
    world_size: int
    deterministic: bool = False
    multicast: bool = True


@dataclass(frozen=True)
class JobPlan:
    name: str
    request: JobRequest
    spec: JobSpec  # what every core is told

    def describe(self, cfg: ApplianceConfig) -> dict[str, object]:
        """The registration answer a worker receives."""
        dp = cfg.dataplane
        mc = self.spec.multicast
        return {
            "name": self.name, "job_id": self.spec.job_id, "cookie": self.spec.cookie,
            "world_size": self.spec.world_size, "deterministic": self.spec.deterministic,
            "segment_bytes": dp.max_payload,
            "endpoints": [
                {"core": i, "host": dp.address, "port": dp.base_port + i, "slots": self.spec.slots}
                for i in range(dp.cores)
            ],
            "multicast": {"group": mc[0], "port": mc[1]} if mc else None,
        }


class Registry:
    def __init__(self, cfg: ApplianceConfig) -> None:
        self.cfg = cfg
        self._by_name: dict[str, JobPlan] = {}
        self._next_id = 1
        groups = ipaddress.IPv4Network(cfg.multicast.groups)
        # Skip the range's first address: 239.x.0.0 style addresses confuse some switches.
        count = min(groups.num_addresses, 65536)
        self._groups = [str(groups.network_address + i) for i in range(1, count)]

    @property
    def jobs(self) -> list[JobPlan]:
        return list(self._by_name.values())

    def find(self, name: str) -> JobPlan | None:
        return self._by_name.get(name)

    def by_id(self, job_id: int) -> JobPlan | None:
        return next((p for p in self._by_name.values() if p.spec.job_id == job_id), None)

    def plan(self, request: JobRequest, cookie: int) -> JobPlan:
        """The plan for `request`: the existing one if the same job registers again."""
        if not request.name or len(request.name) > 128:
            raise AdmissionError("job name must be 1..128 characters")
        if not 1 <= request.world_size <= 4096:
            raise AdmissionError(f"world_size must be 1..4096, got {request.world_size}")
        existing = self._by_name.get(request.name)
        if existing is not None:
            if existing.request != request:
                raise ConflictError(
                    f"job {request.name!r} exists with {existing.request}, not {request}"
                )
            return existing
        job_id = self._next_id
        multicast = None
        if request.multicast and self.cfg.multicast.enabled:
            group = self._groups[(job_id - 1) % len(self._groups)]
            multicast = (group, self.cfg.multicast.port)
        spec = JobSpec(job_id, cookie, request.world_size, self.cfg.jobs.slots,
                       request.deterministic, multicast)
        return JobPlan(request.name, request, spec)

    def commit(self, plan: JobPlan) -> None:
        """Record a plan the data plane accepted."""
        self._by_name[plan.name] = plan
        self._next_id = max(self._next_id, plan.spec.job_id + 1)

    def remove(self, job_id: int) -> JobPlan | None:
        plan = self.by_id(job_id)
        if plan is not None:
            del self._by_name[plan.name]
        return plan
