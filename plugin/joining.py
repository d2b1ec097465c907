"""How a client begins: the jobs checked against each other, its transport opened (UDP, or RoCE
where the jobs ask for it), every job joined from it, and, over UDP, the paths to the cores
checked (`join_jobs`). What comes of it (`Joined`) is what `ApplianceClient` drives; a failure
on the way closes the transport and raises, so nothing is left open."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from reduction_appliance.dataplane.errors import ReductionError

from . import rendezvous
from .hostchecks import buffer_window, fragmenting_routes, say_refusals
from .pathprobe import check_paths
from .rendezvous import JobInfo
from .session import Endpoint
from .transport import UdpWorkerTransport, WorkerTransport

__all__ = ["Joined", "join_jobs"]


@dataclass(frozen=True)
class Joined:
    transport: WorkerTransport
    jobs: list[JobInfo]  # as joined (with their cookies), one per appliance
    joined_here: list[JobInfo]  # those this client joined (jobs given joined are their giver's)
    world_size: int
    # the window per core this host's receive buffer holds, where fewer than the slots (told
    # to the appliance at the join, for its operator's status)
    window_cap: int | None
    endpoints: tuple[Endpoint, ...]  # every core of every appliance, numbered by appliance
    segment_bytes: int  # the least of the jobs'
    epoch: int
    fragmenting: list[str]  # routes to cores that fragment the job's datagrams (hostchecks)


def join_jobs(jobs: list[JobInfo], rank: int, *, local_address: str,
              transport: WorkerTransport | None, join: Callable[..., JobInfo], rejoin: bool,
              lanes: int, probe_path: bool) -> Joined:
    """Join `jobs` as `rank` (ApplianceClient's arguments of the same names say how)."""
    if not jobs:
        raise ReductionError("ApplianceClient needs at least one registered job")
    world = {j.world_size for j in jobs}
    if len(world) != 1:
        raise ReductionError(f"appliances disagree on the world size: {sorted(world)}")
    world_size = world.pop()
    if not 0 <= rank < world_size:
        raise ReductionError(f"rank {rank} is outside world size {world_size}")
    kinds = {j.transport for j in jobs}
    if len(kinds) != 1:
        raise ReductionError(f"one client speaks one transport; these jobs use {sorted(kinds)}")
    if transport is None and kinds == {"roce"}:
        from .roce import connect_jobs  # pyverbs only where a job asks for RoCE

        transport = connect_jobs(jobs, rank, local_address, rendezvous.connect)
    if transport is None:
        udp = UdpWorkerTransport(local_address,
                                 [j.multicast for j in jobs if j.multicast is not None])
        say_refusals(udp)
        transport = udp
    try:
        return _joined(jobs, rank, world_size, transport, join, rejoin, lanes, probe_path)
    except BaseException:
        transport.close()
        raise


def _joined(jobs: list[JobInfo], rank: int, world_size: int, transport: WorkerTransport,
            join: Callable[..., JobInfo], rejoin: bool, lanes: int,
            probe_path: bool) -> Joined:
    udp = transport if isinstance(transport, UdpWorkerTransport) else None
    window_cap = (buffer_window(udp, max(c.slots for j in jobs for c in j.cores),
                                sum(len(j.cores) for j in jobs),
                                min(j.segment_bytes for j in jobs), rank)
                  if udp is not None else None)
    joined = [
        j if j.cookie is not None else join(
            j, rank, transport.source_for((j.cores[0].host, j.cores[0].port)),
            rejoin=rejoin, lanes=lanes, window_cap=window_cap)
        for j in jobs
    ]
    epochs = {j.epoch for j in joined}
    if len(epochs) != 1:
        raise ReductionError(f"the appliances are at different epochs of this job "
                             f"({sorted(epochs)}); resync it")
    endpoints = tuple(replace(e, appliance=a) for a, j in enumerate(joined) for e in j.endpoints)
    segment_bytes = min(j.segment_bytes for j in joined)
    fragmenting: list[str] = []
    if udp is not None:
        fragmenting = fragmenting_routes(udp, endpoints, segment_bytes, rank)
        if probe_path:
            check_paths(udp, joined, rank, segment_bytes)
    return Joined(transport, joined,
                  [j for j, given in zip(joined, jobs, strict=True) if given.cookie is None],
                  world_size, window_cap, endpoints, segment_bytes, epochs.pop(), fragmenting)
