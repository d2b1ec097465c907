"""A DDP communication hook that averages gradient buckets through the appliance, for jobs that
keep Gloo (or anything else) as the default backend::

    from reduction_appliance.plugin.torch_hook import ApplianceHookState, appliance_allreduce_hook
    model = DDP(model)                          # default process group: gloo
    model.register_comm_hook(ApplianceHookState(), appliance_allreduce_hook)

The state's client is configured from the same REDUCTION_* environment variables as the
"reduction" backend (see `plugin.torch_backend`); without REDUCTION_JOB, rank 0 of the state's
group (the default group unless `group=` names another) makes up a job name and broadcasts it
over that group. Each state is a job of its own: with REDUCTION_JOB, the first state on the
default group takes the name as it is (unless the default group runs on the "reduction"
backend, whose job it is), every other one the name with ``.hook<n>`` added
(``.rank<r>.hook<n>`` on another group whose rank 0 is global rank r), n counting the states
that process made.

Buckets are started on one background thread in the order DDP hands them over, with up to
REDUCTION_LANES of them on the wire at once (`plugin.torch_pump`); the hook returns at once
with a Future that completes with the averaged bucket, or fails with the appliance's
`ReductionError` (e.g. `AllreduceTimeout`, `JobAborted`), which DDP raises from backward().
CUDA buckets go through pinned host buffers (`plugin.torch_pump`; `bench.ddp_steps --device
cuda` is the check on a machine with a GPU).

On the default group, ranks that share a host reduce there first, as on the backend
(`plugin.torch_hosts`; ``REDUCTION_HIERARCHY``): a state on another group stays flat.

``ApplianceHookState(compress=torch.bfloat16)`` (or ``torch.float16``) sends each bucket in that
dtype, half the bytes each way, as torch's ``bf16_compress_hook`` does over a ring; but the
appliance adds the ranks' gradients in fp32 and divides before it rounds, once, to the wire's
dtype, where the ring rounds every partial sum on its way and the hook divides each gradient,
rounded, before any is added. On the "reduction" backend, ``compressed_allreduce_hook`` does the
same through the default group (torch's ``bf16_compress_hook`` refuses any backend but NCCL)::

    model.register_comm_hook(torch.bfloat16, compressed_allreduce_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from .client import ApplianceClient
from .rendezvous import JobInfo, leave
from .torch_backend import (
    BACKEND_NAME,
    ApplianceConfig,
    config_from_env,
    connect,
    group_timeout,
    job_name_for,
    leave_at_exit,
    new_job_name,
    new_secret,
)
from .torch_hosts import HostLayout, HostStage, host_key
from .torch_pump import RoundPump

__all__ = ["ApplianceHookState", "appliance_allreduce_hook", "compressed_allreduce_hook"]

# What a bucket may be sent as (`ApplianceHookState.compress`).
_COMPRESSED = (None, torch.bfloat16, torch.float16)

# Hook states this process made as rank 0 of their group, on the default group and on others.
_STATES_MADE: Counter[str] = Counter()


def _job_name(config: ApplianceConfig, group: dist.ProcessGroup) -> str:
    """The job a new state on `group` joins, chosen by the group's rank 0 (see the module
    docstring): unique per group and state, so two models, or a model per group, never meet.
    Another group's name carries its rank 0's global rank, the one process that counts them."""
    if not config.job:
        return new_job_name()
    if group is dist.group.WORLD:
        n = _STATES_MADE["world"]
        _STATES_MADE["world"] += 1
        if n == 0 and dist.get_backend() != BACKEND_NAME:
            return config.job
        return job_name_for(config.job, f"hook{n}")
    n = _STATES_MADE["other"]
    _STATES_MADE["other"] += 1
    return job_name_for(config.job, f"rank{dist.get_global_rank(group, 0)}.hook{n}")


class ApplianceHookState:
    """An `ApplianceClient` joined to the job as this rank, and the thread that drives it."""

    def __init__(self, config: ApplianceConfig | None = None, *,
                 group: dist.ProcessGroup | None = None,
                 compress: torch.dtype | None = None) -> None:
        if compress not in _COMPRESSED:
            raise ValueError(f"compress={compress}: choose torch.bfloat16, torch.float16 or "
                             "None (buckets as they are)")
        #: the dtype buckets travel in (None: their own)
        self.compress = compress
        config = config or config_from_env()
        group = group if group is not None else dist.group.WORLD
        if group is None:
            raise ValueError("torch.distributed is not initialised: call init_process_group "
                             "before making an ApplianceHookState")
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the group given to "
                             "ApplianceHookState: make the state on the group's ranks only")
        self.world_size = dist.get_world_size(group)
        # The group's rank 0 names the job and makes up its join secret unless configured; the
        # group carries both to its other ranks.
        chosen: list[Any] = ([_job_name(config, group), config.secret or new_secret()]
                             if self.rank == 0 else [None, None])
        src = 0 if group is dist.group.WORLD else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(chosen, src=src, group=group)
        self.job, secret = str(chosen[0]), str(chosen[1])
        # A bucket may wait for its peers as long as the group's collectives may (a rank 0
        # writing a checkpoint while the others go on into the next backward), not just the
        # appliance's advised deadline.
        timeout = group_timeout(group) or dist.default_pg_timeout
        name = f"reduction-ddp-hook-{self.rank}"
        layout = self._layout(config, group)
        self.appliance_rank = self.rank  # its host's, where the ranks are staged on hosts
        self.client: ApplianceClient | None = None
        self.jobs: list[JobInfo] = []
        self.pump: RoundPump | HostStage
        if layout is None:
            self.client, self.jobs = connect(config, self.job, secret, self.rank,
                                             self.world_size, timeout)
            self.pump = RoundPump(self.client, name)
            leave_at_exit(self)
            return
        groups: tuple[Any, Any] | None = None
        for ranks in layout.hosts:  # every rank makes every host's groups (new_group's rule)
            made = (dist.new_group(list(ranks), backend="gloo"),
                    dist.new_group(list(ranks), backend="gloo"))
            if self.rank in ranks:
                groups = made
        assert groups is not None
        host = layout.host_of(self.rank)
        leader_rank = layout.hosts[host][0]
        leader = None
        if self.rank == leader_rank:
            self.client, self.jobs = connect(config, self.job, secret, host, len(layout.hosts),
                                             timeout)
            self.appliance_rank = host
            leader = RoundPump(self.client, f"{name}-leader")
        self.pump = HostStage(groups, leader, self.world_size, leader_rank, name,
                              on_broken=self._leave, hosts=layout.describe())
        leave_at_exit(self)

    def _layout(self, config: ApplianceConfig, group: dist.ProcessGroup) -> HostLayout | None:
        """How the ranks share hosts, where they stage on hosts (`plugin.torch_hosts`): on
        the default group only, whose every rank makes this state and so can make the
        hosts' Gloo groups."""
        if config.hierarchy != "auto" or config.deterministic or group is not dist.group.WORLD:
            return None
        keys: list[Any] = [None] * self.world_size
        dist.all_gather_object(keys, host_key(config.local_address))
        layout = HostLayout.of([str(k) for k in keys])
        return layout if layout.staged else None

    def _leave(self) -> None:
        jobs, self.jobs = self.jobs, []
        for info in jobs:
            leave(info, self.appliance_rank)

    def close(self) -> None:
        """Finish the buckets in flight, leave the job at every appliance, close the client
        (even if leaving fails: that error is raised after)."""
        try:
            self.pump.close()
            self._leave()
        finally:
            if self.client is not None:
                self.client.close()

    def __enter__(self) -> "ApplianceHookState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def appliance_allreduce_hook(
    state: ApplianceHookState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket.buffer()` over all ranks through the appliance, off the caller's thread
    (sent as `state.compress`, where it names a dtype)."""
    buffer = bucket.buffer()
    if state.compress is None or buffer.dtype == state.compress:
        return state.pump.submit([buffer], "avg").then(lambda fut: fut.value()[0])
    reduced = state.pump.submit([buffer.to(state.compress)], "avg")
    return reduced.then(lambda fut: buffer.copy_(fut.value()[0]))


def compressed_allreduce_hook(
    dtype: torch.dtype,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket.buffer()` through the default group, sent as `dtype` (16 bits: half the
    bytes). On the "reduction" backend the appliance averages in fp32 and rounds once; on any
    other, as torch's compress hooks do, each rank divides before the sum (a ring's partial
    sums are rounded to `dtype` at every step)."""
    if dtype not in _COMPRESSED[1:]:
        raise ValueError(f"compressed_allreduce_hook's state is the dtype to send: "
                         f"torch.bfloat16 or torch.float16, not {dtype}")
    buffer = bucket.buffer()
    compressed = buffer.to(dtype)
    if dist.get_backend() == BACKEND_NAME:
        work = dist.all_reduce(compressed, op=dist.ReduceOp.AVG, async_op=True)
    else:  # (Gloo has no AVG)
        work = dist.all_reduce(compressed.div_(dist.get_world_size()), async_op=True)
    assert work is not None
    reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(
        lambda fut: buffer.copy_(fut.value()[0]))
    return reduced
