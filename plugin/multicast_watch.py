"""Whether a job's multicast results reach this worker, told from the rounds it finishes.

The appliance sends each result once, to the job's multicast group; a worker that misses it
asks again, and the core answers it alone from the stored copy. Where the network stops
delivering the group to a host (a switch with IGMP snooping and no querier forgets the
group's members a few minutes after they joined, a firewall drops it), every result comes
that way: exact, but each one after a retransmission timeout. Measured on the emulated rack
with the group dropped at one of two workers: six 4 MiB allreduces took 50.7 s instead of
about 0.2 s, 18 484 retransmissions, and nothing said why. The worker sees it plainly: rounds
that finished without one datagram on the group, each needing retransmissions. The client
then says so and asks the appliance for the job's results by unicast fan-out
(`rendezvous.unicast`), which every rank then gets.
"""

from __future__ import annotations

from collections.abc import Sequence

from reduction_appliance.dataplane.errors import ReductionError

from . import rendezvous
from .rendezvous import JobInfo
from .session import Address

__all__ = ["MulticastWatch", "ask_unicast"]

# Finished rounds in a row that heard nothing on the group before it is called unreachable:
# one lost multicast datagram makes a one-segment round look so; three in a row at 1% loss,
# one in a million.
UNHEARD_ROUNDS = 3


class MulticastWatch:
    """Fed each finished round; says once, as a warning to log, when `UNHEARD_ROUNDS` rounds
    in a row were repaired by retransmissions while the group sockets heard nothing."""

    def __init__(self, rank: int, groups: Sequence[Address], local_address: str) -> None:
        self.rank = rank
        self.groups = tuple(dict.fromkeys(groups))
        # 0.0.0.0: the kernel joined the groups on the interface its routes pick for them,
        # on a host with a management network often not the data network's
        self.joined_anywhere = local_address == "0.0.0.0"
        self._heard_at_last = 0  # datagrams the group sockets had taken at the last round's end
        self._unheard = 0  # rounds in a row that heard too few
        self._few = False  # ... and some of them heard some
        self.said = False

    def round_ended(self, heard_on_groups: int, retransmissions: int,
                    segments: int = 1) -> str | None:
        """A round of `segments` results finished when the group sockets had taken
        `heard_on_groups` datagrams in all; the warning, the first time the group looks
        unreachable, else None. A round counts where the group brought under half its results
        and retransmissions at least half: a group that carries only small datagrams (a
        multicast route narrower than the unicast one) brings a round's short last segment
        and nothing else, and once went unnoticed, every call 200 times slower."""
        heard = heard_on_groups - self._heard_at_last
        self._heard_at_last = heard_on_groups
        if 2 * heard >= segments:
            self._unheard = 0
        elif 2 * retransmissions >= segments:  # its results came as answers to asking again
            self._unheard += 1
            self._few = self._few or heard > 0
        if self.said or self._unheard < UNHEARD_ROUNDS:
            return None
        self.said = True
        groups = ", ".join(f"{host}:{port}" for host, port in self.groups)
        how_many = "few" if self._few else "none"
        return (f"rank {self.rank}: the last {self._unheard} allreduces heard {how_many} of their "
                f"results on the job's multicast group {groups}: the rest came as answers to "
                "retransmissions, many times slower. This host does not receive the group"
                + (", or not its full-size datagrams (a multicast route narrower than the "
                   "unicast path, a firewall rule on length)" if self._few else "")
                + ": a switch with IGMP snooping and no querier stops forwarding a group minutes "
                "after it was joined (deploy/host-tuning.md, \"Multicast on the switch\"), or "
                "a firewall drops it"
                + (", or this host joined the group on another interface than the data "
                   "network's (no local address was given: set REDUCTION_LOCAL_ADDRESS, or the "
                   "client's local_address, to this host's data-network address)"
                   if self.joined_anywhere else "")
                + ". Give the data VLAN an IGMP querier, or set the appliance's "
                "multicast.enabled = false")


def ask_unicast(jobs: Sequence[JobInfo], rank: int) -> tuple[list[JobInfo], list[str]]:
    """Ask each appliance of a multicast job for its results by unicast from now on: the jobs
    as they are then, and what each appliance answered, for the warning (a refusal is said,
    not raised: the rounds go on as they went)."""
    now_jobs, asked = [], []
    for job in jobs:
        if job.multicast is not None:
            try:
                job = rendezvous.unicast(job, rank)
                asked.append(f"{job.appliance}: results by unicast from now on")
            except ReductionError as exc:
                asked.append(f"{job.appliance} could not be asked for unicast results ({exc})")
        now_jobs.append(job)
    return now_jobs, asked
