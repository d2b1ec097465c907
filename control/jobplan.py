"""A job as the registry plans it: what its ranks asked for (`JobRequest`, alike from every
rank), and what the registry decided (`JobPlan`: the spec every core is told, who joined, its
state in the table of registry.py). Values only."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from reduction_appliance.dataplane.registration import EndpointInfo, JobDescription
from reduction_appliance.dataplane.spec import JobSpec

from .aborts import Aborted
from .config import ApplianceConfig

__all__ = ["JobPlan", "JobRequest", "JobState"]


class JobState(Enum):
    CREATED = "created"
    ACTIVE = "active"
    DONE = "done"
    ABORTED = "aborted"
    EVICTED = "evicted"


@dataclass(frozen=True)
class JobRequest:
    """What every rank registering a job must agree on (the secret is not part of it)."""

    name: str
    world_size: int
    deterministic: bool = False
    #: results to a multicast group; None: the transport's default (UDP: yes; RoCE: no, each
    #: result is RDMA-written to every worker; yes: UD multicast chunks, `dataplane.roce`)
    multicast: bool | None = None
    slots: int = 0  # slot pairs per core; 0 = the appliance's default (jobs.slots)
    transport: str = "udp"  # or "roce": every rank connects queue pairs (config [roce])


@dataclass(frozen=True)
class JobPlan:
    name: str
    request: JobRequest
    spec: JobSpec  # what every core is told
    created: float  # the registry clock when admitted
    secret: str  # the join secret
    state: JobState = JobState.CREATED
    joined: frozenset[int] = field(default_factory=frozenset)  # ranks joined now
    seen: frozenset[int] = field(default_factory=frozenset)  # ranks that ever joined
    lanes: int = 0  # the lanes the joined ranks split the slots into (0: none joined yet)
    # joined rank -> the window per core its host's receive buffer holds, where fewer than
    # the slots (the worker says so when it joins: plugin/hostchecks.py)
    windows_held: dict[int, int] = field(default_factory=dict)
    # registered shortly after a job of the same name, spec and secret was aborted: until a
    # rank of that one joins this (a restart), a rank that joins is a late one of the aborted
    # run (control/aborts.py)
    late_for: Aborted | None = None

    def describe(self, cfg: ApplianceConfig, *, member: bool = False) -> JobDescription:
        """The registration answer: with the cookie only for a member (one that joined with
        the secret), never the secret itself (the creator gets it from `Registry.plan`)."""
        dp = cfg.dataplane
        return JobDescription(
            name=self.name, job_id=self.spec.job_id,
            cookie=self.spec.cookie if member else None,
            world_size=self.spec.world_size, deterministic=self.spec.deterministic,
            segment_bytes=(cfg.roce.segment_bytes if self.request.transport == "roce"
                           else dp.max_payload), state=self.state.value,
            joined=tuple(sorted(self.joined)), deadline_s=cfg.jobs.deadline_s,
            endpoints=tuple(EndpointInfo(i, dp.address, dp.base_port + i, self.spec.slots)
                            for i in range(dp.cores)),
            multicast=self.spec.multicast, epoch=self.spec.epoch,
            liveness_s=self.spec.liveness_timeout, transport=self.request.transport,
            queue_target_s=cfg.jobs.queue_target_s,
        )
