"""The numpy worker API, under the product's import root::

    from reduction_appliance.client import ApplianceClient, register

    job = register("198.18.0.1:7070", "my-job", world_size=4, secret=secret)
    with ApplianceClient([job], rank, local_address="198.18.0.101") as client:
        client.allreduce(grads, op="sum")
    leave(job, rank)  # done: the leave that leaves no rank joined frees the job at once
"""

from reduction_appliance.dataplane.errors import (
    AllreduceTimeout,
    ApplianceEnded,
    ApplianceSilent,
    JobAborted,
    PathTooNarrow,
    RankEnded,
    RankLeft,
    RankSilent,
    ReductionError,
)
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import JobInfo, RendezvousError, leave, register

__all__ = [
    "AllreduceTimeout",
    "ApplianceClient",
    "ApplianceEnded",
    "ApplianceSilent",
    "JobAborted",
    "JobInfo",
    "PathTooNarrow",
    "RankEnded",
    "RankLeft",
    "RankSilent",
    "ReductionError",
    "RendezvousError",
    "leave",
    "register",
]
