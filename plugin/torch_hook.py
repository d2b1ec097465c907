"""A DDP communication hook that averages gradient buckets through the appliance, for jobs that
keep Gloo (or anything else) as the default backend::

    from reduction_appliance.plugin.torch_hook import ApplianceHookState, appliance_allreduce_hook
    model = DDP(model)                          # default process group: gloo
    model.register_comm_hook(ApplianceHookState(), appliance_allreduce_hook)

The state's client is configured from the same REDUCTION_* environment variables as the
"reduction" backend (see `plugin.torch_backend`); without REDUCTION_JOB, rank 0 makes up a job
name and broadcasts it over the default process group. Buckets are started on one background
thread in the order DDP hands them over, with up to REDUCTION_LANES of them on the wire at once
(`plugin.torch_pump`); the hook returns at once with a Future that completes with the averaged
bucket, or fails with the appliance's `ReductionError` (e.g. `AllreduceTimeout`, `JobAborted`),
which DDP raises from backward(). CUDA buckets go through pinned host buffers
(`plugin.torch_pump`; `bench.ddp_steps --device cuda` is the check on a machine with a GPU).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.
from typing import Any

import torch
import torch.distributed as dist

from .rendezvous import leave
from .torch_backend import ApplianceConfig, config_from_env, connect, new_job_name, new_secret
from .torch_pump import RoundPump

__all__ = ["ApplianceHookState", "appliance_allreduce_hook"]


class ApplianceHookState:
    """An `ApplianceClient` joined to the job as this rank, and the thread that drives it."""

    def __init__(self, config: ApplianceConfig | None = None, *,
                 group: dist.ProcessGroup | None = None) -> None:
        config = config or config_from_env()
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Rank 0 names the job and makes up its join secret unless configured; the default
        # group carries both to the other ranks.
        chosen: list[Any] = ([config.job or new_job_name(), config.secret or new_secret()]
                             if self.rank == 0 else [None, None])
        dist.broadcast_object_list(chosen, src=0, group=group)
        self.job, secret = str(chosen[0]), str(chosen[1])
        self.client, self.jobs = connect(config, self.job, secret, self.rank, self.world_size)
        self.pump = RoundPump(self.client, f"reduction-ddp-hook-{self.rank}")

    def close(self) -> None:
        """Finish the buckets in flight, leave the job at every appliance, close the client
        (even if leaving fails: that error is raised after)."""
        try:
            self.pump.close()
            for info in self.jobs:
                leave(info, self.rank)
        finally:
            self.client.close()

    def __enter__(self) -> "ApplianceHookState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def appliance_allreduce_hook(
    state: ApplianceHookState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """Average `bucket.buffer()` over all ranks through the appliance, off the caller's thread."""
    reduced = state.pump.submit([bucket.buffer()], "avg")
    return reduced.then(lambda fut: fut.value()[0])
